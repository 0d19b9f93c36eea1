"""How a block's bytes move between the caller and one agent: a strategy per replica, the transfer engine's part.

The shape is Mooncake's ``TransferSubmitter``: the store protocol is the
control (``XALLOC``/``XLOCATE`` say where a block lands or lives and grant a
capability for exactly that extent, ``COMMIT`` publishes it, ``RELEASE`` ends
the reader's lease and revokes its capabilities), and the bytes move by the
strategy ``choose`` picks for that agent and buffer:

- ``ENGINE``: a transfer engine the caller passes in (``daybreak.agent.transfer.TransferEngine``
  fits ``DataEngine``) moves the bytes one-sided into or out of the agent's registered
  segments: shm on the same node, link for device buffers (Sunrise Link, CUDA IPC), rdma
  across nodes (GDR for device buffers). Device-memory buffers always take this path.
- ``MEMCPY``: same node without an engine: one memcpy through the agent's mapped /dev/shm.
- ``STREAM``: the store's own TCP stream, one round trip per batch; it stays the path over
  plain tcp because it was measured faster than the engine's tcp (docs/performance.md).

The engine is handed in and used only through ``DataEngine``'s plain primitives; an engine pod builds it with
``engine_for_pod`` (the agent's own builder, loaded on call: of the agent the client imports only the transfer
engine and the runtimes, the library engine pods load).
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from daybreak.pool import protocol as p
from daybreak.pool.checksum import crc32c
from daybreak.pool.connection import Connection

if TYPE_CHECKING:
    from daybreak.api.enginepod import EnginePodEnv

log = logging.getLogger(__name__)


# The KVPool API's transport names (api/kvpool.py Transport; the client does not import the API package,
# tests/operator/test_pool_measured_status.py checks the two agree).
TRANSPORTS = ("rdma", "link", "shm", "tcp")


class Strategy(enum.Enum):
    ENGINE = "engine"
    MEMCPY = "memcpy"
    STREAM = "stream"


class DataEngine(Protocol):
    """What the client needs of a transfer engine; ``daybreak.agent.transfer.TransferEngine`` implements it."""

    @property
    def transports(self) -> tuple[str, ...]: ...

    def open_remote(self, descriptor: str) -> Any: ...

    def route(self, remote: Any) -> tuple[str, ...]: ...

    def move(self, moves: Sequence[tuple[str, Any, int, Any, int]], *, timeout_s: float | None = None,
             capabilities: Sequence[bytes] | None = None) -> list[tuple[bool, str, str]]: ...

    def device_memory(self, device: int, ptr: int, size: int) -> Any: ...

    def register_segment(self, memory: Any) -> Any: ...

    def unregister_segment(self, segment: Any) -> None: ...


def engine_for_pod(pod: EnginePodEnv, *, token: str, node: str | None = None, runtime: Any = None) -> DataEngine:
    """A started transfer engine for an engine pod, from its contract (``client.env.engine_pod_env()``): the same
    builder the agent uses (``TransferEngine.from_config``), through ``EngineConfig.for_engine_pod``.

    ``token`` is the credential the pod reads with (``client.env.read_pool_token``); ``node`` the pod's node name
    (shm and link reach only the agent on the same node); ``runtime`` an accelerator runtime for device buffers
    (``daybreak.agent.runtime.load_runtime``). The caller closes the engine after the client. The transfer engine
    is loaded here, not at import, so ``import daybreak.client`` stays light.
    """
    from daybreak.agent.transfer import EngineConfig, TransferEngine

    config = EngineConfig.for_engine_pod(pod, token=token, node=node)
    return TransferEngine.from_config(config, runtime=runtime).start()


@dataclass(frozen=True)
class DeviceRef:
    """A caller's device-memory buffer: device index, device pointer, size in bytes."""

    device: int
    ptr: int
    size: int

    def __len__(self) -> int:
        return self.size


def device_ref(buffer: Any) -> DeviceRef | None:
    """A device buffer (anything with ``device``, ``ptr`` or ``address``, and ``size``) as a DeviceRef; else None."""
    if isinstance(buffer, DeviceRef):
        return buffer
    try:
        memoryview(buffer)
        return None  # host memory: anything exporting the buffer protocol
    except TypeError:
        pass
    device, size = getattr(buffer, "device", None), getattr(buffer, "size", None)
    ptr = getattr(buffer, "ptr", getattr(buffer, "address", None))
    if isinstance(device, int) and isinstance(ptr, int) and isinstance(size, int):
        return DeviceRef(device, ptr, size)
    return None


class EngineDataPath:
    """Moves blocks for one client through a transfer engine; remembers each agent's segments."""

    def __init__(self, engine: DataEngine, *, timeout_seconds: float,
                 allowed: Sequence[str] | None = None) -> None:
        self.engine = engine
        self.timeout = timeout_seconds
        # The pool's transports (None: all): a first route outside them is not taken.
        self.allowed = frozenset(allowed if allowed is not None else TRANSPORTS)
        self._remotes: dict[str, dict[str, Any]] = {}  # agent -> segment id -> engine remote
        self.used: dict[str, int] = {}  # bytes per transport the engine reported
        # rdma moves only registered memory: host buffers bounce through one registered staging
        # area (a copy, but never an MR left on a caller's buffer that may be freed and reused)
        self._staging: Any = None
        self._staging_view: memoryview | None = None

    def forget(self, agent: str) -> None:
        self._remotes.pop(agent, None)

    def remotes(self, agent: str, conn: Connection) -> dict[str, Any]:
        found = self._remotes.get(agent)
        if found is None:
            found = {}
            for entry in conn.segments():
                remote = self.engine.open_remote(entry.descriptor)
                found[remote.segment_id] = remote
            self._remotes[agent] = found
        return found

    def choose(self, agent: str, conn: Connection, *, device: bool) -> Strategy:
        """ENGINE for device buffers and where the engine's first transport is one-sided and allowed; else
        MEMCPY/STREAM (the caller's choice between those two honours the allowed list too)."""
        remotes = self.remotes(agent, conn)
        if device:
            return Strategy.ENGINE
        first = {self.engine.route(r)[:1] for r in remotes.values()}
        one_sided = {"shm", "rdma", "link"} & self.allowed
        if remotes and all(f and f[0] in one_sided for f in first):
            return Strategy.ENGINE
        return Strategy.STREAM

    def _local(self, buf: memoryview | DeviceRef) -> Any:
        return self.engine.device_memory(buf.device, buf.ptr, buf.size) if isinstance(buf, DeviceRef) else buf

    def _stage(self, total: int) -> memoryview:
        if self._staging_view is None or len(self._staging_view) < total:
            if self._staging is not None:
                self.engine.unregister_segment(self._staging)
            buf = bytearray(max(total, 4 << 20))
            self._staging = self.engine.register_segment(buf)
            self._staging_view = memoryview(buf)
        return self._staging_view

    def _run(self, moves: list[tuple[str, Any, int, Any, int]], caps: list[bytes]) -> list[tuple[bool, str, str]]:
        """Run the moves; ``caps[i]`` is the agent's grant for move i (XLOCATE/XALLOC), handed back untouched."""
        if not moves:
            return []
        staged = [i for i, m in enumerate(moves) if isinstance(m[3], memoryview)
                  and self.engine.route(m[1])[:1] == ("rdma",)]
        sent: list[tuple[Any, ...]] = list(moves)
        offsets: dict[int, int] = {}
        if staged:
            area = self._stage(sum(moves[i][4] for i in staged))
            at = 0
            for i in staged:
                op, remote, offset, local, length = moves[i]
                if op == "write":
                    area[at:at + length] = local[:length]
                sent[i] = (op, remote, offset, self._staging, length, at)
                offsets[i] = at
                at += length
        results = self.engine.move(sent, timeout_s=self.timeout, capabilities=caps)
        for i, at in offsets.items():
            op, _, _, local, length = moves[i]
            if op == "read" and results[i][0]:
                assert self._staging_view is not None
                local[:length] = self._staging_view[at:at + length]
        for (_, _, _, _, length), (ok, transport, _) in zip(moves, results, strict=True):
            if ok:
                self.used[transport] = self.used.get(transport, 0) + length
        return results

    def put(self, agent: str, conn: Connection, keys: list[str], bufs: Sequence[memoryview | DeviceRef],
            checksums: list[int], *, tier: int, pin_seconds: int, flags: int) -> list[p.Status] | None:
        """XALLOC, one-sided WRITEs, COMMIT; None when a transfer failed (the caller falls back)."""
        device = any(isinstance(b, DeviceRef) for b in bufs)
        remotes = self.remotes(agent, conn)
        reply = conn.xalloc(keys, [len(b) for b in bufs], checksums, tier=tier, pin_seconds=pin_seconds,
                            agent_crc=device)
        moves = []
        caps: list[bytes] = []
        for i, (info, buf) in enumerate(zip(reply.blocks, bufs, strict=True)):
            if info.status == p.Status.OK:
                remote = remotes.get(info.where)
                if remote is None:
                    conn.commit(reply.lease_id, abort=True)
                    self.forget(agent)  # the agent registered new segments: ask again next time
                    return None
                moves.append(("write", remote, info.offset, self._local(buf), len(buf)))
                caps.append(reply.capability(i))
        try:
            results = self._run(moves, caps)
        except BaseException:
            conn.commit(reply.lease_id, abort=True)
            raise
        failed = [error for ok, _, error in results if not ok]
        if failed:
            log.warning("event=engine_put_failed agent=%s blocks=%d cause=%r", agent, len(failed), failed[0])
            conn.commit(reply.lease_id, abort=True)
            return None
        committed = conn.commit(reply.lease_id, flags=flags)
        return [i.status if c.status == p.Status.OK else c.status
                for i, c in zip(reply.blocks, committed, strict=True)]

    def get(self, agent: str, conn: Connection, keys: list[str], bufs: Sequence[memoryview | DeviceRef], *,
            flags: int, verify: bool) -> tuple[list[p.BlockInfo], set[int]] | None:
        """XLOCATE, one-sided READs, RELEASE; the indices verified here (host buffers; device ones are trusted)."""
        remotes = self.remotes(agent, conn)
        reply = conn.xlocate(keys, flags=flags)
        moves: list[tuple[str, Any, int, Any, int]] = []
        caps: list[bytes] = []
        which: list[int] = []
        stream: list[int] = []
        try:
            for i, (info, buf) in enumerate(zip(reply.blocks, bufs, strict=True)):
                if info.status != p.Status.OK:
                    continue
                if info.size > len(buf):
                    info.status = p.Status.TOO_SMALL
                elif not info.where or info.where not in remotes:
                    stream.append(i)
                elif info.size:
                    local = self._local(buf) if isinstance(buf, DeviceRef) else buf[:info.size]
                    moves.append(("read", remotes[info.where], info.offset, local, info.size))
                    caps.append(reply.capability(i))
                    which.append(i)
            results = self._run(moves, caps)
        finally:
            conn.release(reply.lease_id)
        verified: set[int] = set()
        for i, (ok, _, error) in zip(which, results, strict=True):
            info, buf = reply.blocks[i], bufs[i]
            if not ok:
                log.warning("event=engine_get_failed agent=%s key=%s cause=%r", agent, keys[i], error)
                stream.append(i)
            elif isinstance(buf, DeviceRef) or not verify:
                verified.add(i)  # device memory cannot be checksummed from the host: the agent's CRC stands
            elif crc32c(buf[:info.size]) == info.checksum:
                verified.add(i)
            else:
                info.status = p.Status.CORRUPT
        host = [i for i in stream if not isinstance(bufs[i], DeviceRef)]
        for i in stream:
            if isinstance(bufs[i], DeviceRef):
                reply.blocks[i] = p.BlockInfo(p.Status.MISS)
        if host:  # not in a registered segment, or the engine failed: the stream, one round trip
            got = conn.get_into([keys[i] for i in host], [bufs[i] for i in host])  # type: ignore[misc]
            for i, info in zip(host, got, strict=True):
                reply.blocks[i] = info
        return reply.blocks, verified
