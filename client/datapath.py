"""How a block's bytes move between the caller and one agent: a strategy per replica, the transfer engine's part.

The shape is Mooncake's ``TransferSubmitter``: the store protocol is the
control (``XALLOC``/``XLOCATE`` say where a block lands or lives and grant a
capability for exactly that extent, ``COMMIT`` publishes it, ``RELEASE`` ends
the reader's lease and revokes its capabilities), and the bytes move by the
strategy ``choose`` picks for that agent and buffer:

- ``ENGINE``: a transfer engine the caller passes in (``daybreak.agent.transfer.TransferEngine``
  fits ``DataEngine``) moves the bytes one-sided into or out of the agent's registered
  segments: shm on the same node, link for device buffers (Sunrise Link, CUDA IPC), rdma
  across nodes (GDR for device buffers). Device-memory buffers always try this path first.
- ``MEMCPY``: same node without an engine: one memcpy through the agent's mapped /dev/shm.
- ``STREAM``: the store's own TCP stream, one round trip per batch; it stays the path over
  plain tcp because it was measured faster than the engine's tcp (docs/performance.md).

Device buffers (``DeviceRef``) take, per agent and in this order: the device link into an HBM segment
(``link``); one device DMA straight into a same-node DRAM segment the engine maps and pins once
(``shm-dma``); across nodes RDMA on the device memory itself where a NIC shares the device's PCIe switch
(``rdma-gdr``: the range is registered with the NICs once, on first use) or through the engine's one pinned
staging pool (``rdma-staged``); tcp last, staged through pinned host memory (``tcp-staged``: the engine's tcp,
or the store's stream when the engine cannot reach the agent at all, ``stream-staged``). The path each agent
gets is logged once (``event=datapath agent=... path=... reason=...``), bytes are counted per transport
(``EngineDataPath.used``, the engine's ``bytes_used``/``bytes_staged``) and a fallback is counted with its
reason (the engine's ``fallback_reasons``, ``daybreak_transfer_fallback_reasons``).

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

    def register_segment(self, memory: Any, *, name: str | None = None, pin: bool = False) -> Any: ...

    def unregister_segment(self, segment: Any) -> None: ...

    def path_of(self, remote: Any, *, device: int | None, transport: str | None = None,
                registered: bool = False) -> tuple[str, str]: ...

    def gdr_nics(self, device: int) -> tuple[str, ...]: ...

    def copy_from_device(self, dst: Any, memory: Any) -> None: ...

    def copy_to_device(self, memory: Any, src: Any) -> None: ...

    def record_fallback(self, preferred: str, used: str, reason: str, nbytes: int) -> None: ...


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
        self.used: dict[str, int] = {}  # bytes per transport the engine reported ("stream": the store's)
        # rdma moves only registered memory: host buffers bounce through one registered staging
        # area (a copy, but never an MR left on a caller's buffer that may be freed and reused); it is
        # pinned too, so device buffers staged for the store's stream are one DMA into it
        self._staging: Any = None
        self._staging_view: memoryview | None = None
        # device ranges registered with the NICs for GPUDirect: once per range, kept until close (a KV cache
        # lives as long as its engine; a range inside one registered earlier reuses it)
        self._device_segments: dict[tuple[int, int, int], Any] = {}
        self.paths: dict[tuple[str, str], str] = {}  # (agent, path) -> reason: logged once each
        self.failure = ""  # why the last ``put`` returned None: "no_segments" or "engine_failed"

    def forget(self, agent: str) -> None:
        self._remotes.pop(agent, None)

    def note_path(self, agent: str, path: str, reason: str) -> None:
        """Log the path ``agent``'s blocks take, once per agent and path."""
        if (agent, path) not in self.paths:
            self.paths[(agent, path)] = reason
            log.info("event=datapath agent=%s path=%s reason=%r", agent, path, reason)

    def close(self) -> None:
        """Unregister what this data path registered with the engine (the engine itself is the caller's)."""
        for segment in [*self._device_segments.values(), *([self._staging] if self._staging is not None else [])]:
            try:
                self.engine.unregister_segment(segment)
            except (KeyError, RuntimeError):
                pass  # the engine was closed first: nothing is served any more
        self._device_segments.clear()
        self._staging = self._staging_view = None

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

    def _local(self, buf: memoryview | DeviceRef, remote: Any) -> tuple[Any, ...]:
        """The move's local side for ``buf`` towards ``remote``: ``(local,)`` or ``(segment, offset)``.

        A device buffer whose first route is rdma and whose device has a GPUDirect NIC is registered with
        the NICs (once per range) so the NIC reads and writes device memory itself; otherwise the engine
        stages it (pinned pool) or reaches it directly (link, shm-dma)."""
        if not isinstance(buf, DeviceRef):
            return (buf,)
        memory = self.engine.device_memory(buf.device, buf.ptr, buf.size)
        if self.engine.route(remote)[:1] != ("rdma",) or not self.engine.gdr_nics(buf.device):
            return (memory,)
        for (device, ptr, size), segment in self._device_segments.items():
            if device == buf.device and ptr <= buf.ptr and buf.ptr + buf.size <= ptr + size:
                return (segment, buf.ptr - ptr)
        segment = self.engine.register_segment(memory, name=f"kv-dev{buf.device}-{buf.ptr:x}-{buf.size:x}")
        self._device_segments[(buf.device, buf.ptr, buf.size)] = segment
        return (segment, 0)

    def _stage(self, total: int) -> memoryview:
        if self._staging_view is None or len(self._staging_view) < total:
            if self._staging is not None:
                self.engine.unregister_segment(self._staging)
            buf = bytearray(max(total, 4 << 20))
            self._staging = self.engine.register_segment(buf, pin=True)
            self._staging_view = memoryview(buf)
        return self._staging_view

    def _run(self, agent: str, moves: list[tuple[Any, ...]], caps: list[bytes],
             devices: list[int | None]) -> list[tuple[bool, str, str]]:
        """Run the moves; ``caps[i]`` is the agent's grant for move i (XLOCATE/XALLOC), handed back untouched;
        ``devices[i]`` the device of move i's local memory (None: host). Notes the path each move took."""
        results = self._move(moves, caps)
        for move, device, (ok, transport, error) in zip(moves, devices, results, strict=True):
            if not ok:
                continue
            registered = device is not None and len(move) > 5  # (segment, offset): a range registered for GDR
            first, _ = self.engine.path_of(move[1], device=device, registered=registered)
            path, reason = self.engine.path_of(move[1], device=device, transport=transport, registered=registered)
            if path != first:
                reason = f"fell back from {first}: {error or reason}"
            self.note_path(agent, path, reason)
        return results

    def _move(self, moves: list[tuple[Any, ...]], caps: list[bytes]) -> list[tuple[bool, str, str]]:
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
        for move, (ok, transport, _) in zip(moves, results, strict=True):
            if ok:
                self.used[transport] = self.used.get(transport, 0) + move[4]
        return results

    def put(self, agent: str, conn: Connection, keys: list[str], bufs: Sequence[memoryview | DeviceRef],
            checksums: list[int], *, tier: int, pin_seconds: int, flags: int) -> list[p.Status] | None:
        """XALLOC, one-sided WRITEs, COMMIT; None when the engine could not (the caller falls back; ``failure``
        says why)."""
        device = any(isinstance(b, DeviceRef) for b in bufs)
        remotes = self.remotes(agent, conn)
        reply = conn.xalloc(keys, [len(b) for b in bufs], checksums, tier=tier, pin_seconds=pin_seconds,
                            agent_crc=device)
        moves: list[tuple[Any, ...]] = []
        caps: list[bytes] = []
        devices: list[int | None] = []
        for i, (info, buf) in enumerate(zip(reply.blocks, bufs, strict=True)):
            if info.status == p.Status.OK:
                remote = remotes.get(info.where)
                if remote is None:
                    conn.commit(reply.lease_id, abort=True)
                    self.forget(agent)  # the agent registered new segments: ask again next time
                    self.failure = "no_segments"
                    return None
                local = self._local(buf, remote)
                moves.append(("write", remote, info.offset, local[0], len(buf), *local[1:]))
                caps.append(reply.capability(i))
                devices.append(buf.device if isinstance(buf, DeviceRef) else None)
        try:
            results = self._run(agent, moves, caps, devices)
        except BaseException:
            conn.commit(reply.lease_id, abort=True)
            raise
        failed = [error for ok, _, error in results if not ok]
        if failed:
            log.warning("event=engine_put_failed agent=%s blocks=%d cause=%r", agent, len(failed), failed[0])
            conn.commit(reply.lease_id, abort=True)
            self.failure = "engine_failed"
            return None
        committed = conn.commit(reply.lease_id, flags=flags)
        return [i.status if c.status == p.Status.OK else c.status
                for i, c in zip(reply.blocks, committed, strict=True)]

    def get(self, agent: str, conn: Connection, keys: list[str], bufs: Sequence[memoryview | DeviceRef], *,
            flags: int, verify: bool) -> tuple[list[p.BlockInfo], set[int]] | None:
        """XLOCATE, one-sided READs, RELEASE; the indices verified here (host buffers; device ones are trusted).

        Blocks the engine could not read (not in a registered segment, or the transfer failed) come by the
        store's stream: host buffers straight into the caller's buffer, device buffers staged (``stream_get``)."""
        remotes = self.remotes(agent, conn)
        reply = conn.xlocate(keys, flags=flags)
        moves: list[tuple[Any, ...]] = []
        caps: list[bytes] = []
        devices: list[int | None] = []
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
                    remote = remotes[info.where]
                    local = self._local(buf, remote) if isinstance(buf, DeviceRef) else (buf[:info.size],)
                    moves.append(("read", remote, info.offset, local[0], info.size, *local[1:]))
                    caps.append(reply.capability(i))
                    devices.append(buf.device if isinstance(buf, DeviceRef) else None)
                    which.append(i)
            results = self._run(agent, moves, caps, devices)
        finally:
            conn.release(reply.lease_id)
        verified: set[int] = set()
        failed = ""
        for i, (ok, _, error) in zip(which, results, strict=True):
            info, buf = reply.blocks[i], bufs[i]
            if not ok:
                log.warning("event=engine_get_failed agent=%s key=%s cause=%r", agent, keys[i], error)
                stream.append(i)
                failed = failed or error
            elif isinstance(buf, DeviceRef) or not verify:
                verified.add(i)  # device memory cannot be checksummed from the host: the agent's CRC stands
            elif crc32c(buf[:info.size]) == info.checksum:
                verified.add(i)
            else:
                info.status = p.Status.CORRUPT
        if stream:  # not in a registered segment, or the engine failed: the stream, one round trip
            reason = "engine_failed" if failed else "no_segments"
            got, checked = self.stream_get(agent, conn, [keys[i] for i in stream], [bufs[i] for i in stream],
                                           flags=0, reason=reason)
            for j, (i, info) in enumerate(zip(stream, got, strict=True)):
                reply.blocks[i] = info
                if j in checked:
                    verified.add(i)
        return reply.blocks, verified

    # -- the store's stream, device buffers staged through pinned host memory (tcp last) -------------

    def _preferred(self, agent: str) -> str:
        """The engine's first transport to ``agent``'s segments (the fallback's ``preferred`` label)."""
        firsts = {self.engine.route(r)[:1] for r in (self._remotes.get(agent) or {}).values()}
        return firsts.pop()[0] if len(firsts) == 1 and () not in firsts else "none"

    def _staged_views(self, bufs: Sequence[memoryview | DeviceRef]) -> list[memoryview]:
        """Host views for ``bufs``: device buffers get a slice of the pinned staging area, host ones stay."""
        area = self._stage(sum(len(b) for b in bufs if isinstance(b, DeviceRef)))
        out: list[memoryview] = []
        at = 0
        for b in bufs:
            if isinstance(b, DeviceRef):
                out.append(area[at:at + b.size])
                at += b.size
            else:
                out.append(b)
        return out

    def stream_put(self, agent: str, conn: Connection, keys: list[str], bufs: Sequence[memoryview | DeviceRef], *,
                   tier: int, pin_seconds: int, flags: int, reason: str) -> list[p.Status]:
        """Put over the store's stream, device buffers staged: one D2H each into the pinned staging area, then
        checksummed on the host like any block (no agent CRC needed). ``reason`` says why the engine was not it."""
        views = self._staged_views(bufs)
        staged = 0
        for buf, view in zip(bufs, views, strict=True):
            if isinstance(buf, DeviceRef):
                self.engine.copy_from_device(view, self.engine.device_memory(buf.device, buf.ptr, buf.size))
                staged += buf.size
        checksums = [crc32c(v) for v in views]
        got = [i.status for i in conn.put(keys, views, checksums, pin_seconds=pin_seconds, tier=tier, flags=flags)]
        self._count_stream(agent, bufs, staged, reason)
        return got

    def stream_get(self, agent: str, conn: Connection, keys: list[str], bufs: Sequence[memoryview | DeviceRef], *,
                   flags: int, reason: str) -> tuple[list[p.BlockInfo], set[int]]:
        """Get over the store's stream, device buffers staged: read into the pinned staging area, check the CRC
        there (so a device reader is verified on this path), then one H2D per block. Returns the infos and the
        indices verified here."""
        views = self._staged_views(bufs)
        got = conn.get_into(keys, views, flags=flags)
        verified: set[int] = set()
        staged = 0
        for j, (buf, view, info) in enumerate(zip(bufs, views, got, strict=True)):
            if not isinstance(buf, DeviceRef) or info.status != p.Status.OK:
                continue
            if crc32c(view[:info.size]) != info.checksum:
                info.status = p.Status.CORRUPT  # never copied into the caller's device memory
                continue
            if info.size:
                self.engine.copy_to_device(self.engine.device_memory(buf.device, buf.ptr, info.size),
                                           view[:info.size])
            staged += info.size
            verified.add(j)
        self._count_stream(agent, bufs, staged, reason)
        return got, verified

    def _count_stream(self, agent: str, bufs: Sequence[memoryview | DeviceRef], staged: int, reason: str) -> None:
        total = sum(len(b) for b in bufs)
        self.used["stream"] = self.used.get("stream", 0) + total
        device = next((b.device for b in bufs if isinstance(b, DeviceRef)), None)
        if device is None:
            return
        preferred = self._preferred(agent)
        self.engine.record_fallback(preferred, "stream", reason, staged)
        self.note_path(agent, "stream-staged", f"{reason}: the engine has no path to the agent's segments "
                                               f"(preferred {preferred}); device buffers staged through "
                                               "pinned host memory over the store's stream")
