"""``KVPoolClient``: batch put/get/exists/remove against a pool of store agents, zero-copy into caller buffers.

The client ranks the live agents for each key with the same rendezvous hash
the agents use, so it reaches a key's home in one hop with no directory
service. Same-node agents are read and written through their shared-memory
segments (one memcpy); others over TCP with ``recv_into`` straight into the
caller's buffer. Every block read is checked against the CRC-32C its writer
computed; a mismatch is reported to the agent and the next replica is tried.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import re
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal

from daybreak.client.datapath import TRANSPORTS, DataEngine, DeviceRef, EngineDataPath, Strategy, device_ref
from daybreak.errors import DaybreakError
from daybreak.pool import credentials
from daybreak.pool import protocol as p
from daybreak.pool.checksum import copy_crc32c, crc32c
from daybreak.pool.connection import Connection, RemoteError
from daybreak.pool.handshake import AuthenticationFailed
from daybreak.pool.placement import rank
from daybreak.pool.shm import BACKING_WINDOW, Backing, ShmSegment
from daybreak.pool.tls import client_context

log = logging.getLogger(__name__)

ALL_TRANSPORTS = TRANSPORTS  # default: every one allowed
_NAMESPACE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_DOWN_SECONDS = 2.0
_MAX_BATCH_KEYS = 1024
_MAX_BATCH_BYTES = 1 << 30
_MAX_IDLE_SECONDS = 60.0  # reconnect before reusing an older idle connection (agents close idle ones)
_SPLIT_BYTES = 4 << 20  # same-node reads of a warm batch this large copy on two threads


class KVPoolError(DaybreakError):
    """The pool could not be reached or refused the client (for example a wrong token)."""


class KVPoolAuthorizationError(KVPoolError):
    """The credential does not allow this: another namespace, or an operation for the pool's agents only."""


class KVPoolQuotaError(KVPoolError):
    """An agent refused the request for one of the namespace's quotas (docs/store.md "Fair share"); retry later."""


def _view(buffer: Any, index: int, *, writable: bool) -> memoryview:
    try:
        view = memoryview(buffer)
    except TypeError:
        raise TypeError(f"buffers[{index}] is a {type(buffer).__name__}, not a bytes-like object") from None
    if not view.c_contiguous:
        raise ValueError(f"buffers[{index}] is not C-contiguous")
    if writable and view.readonly:
        raise ValueError(f"buffers[{index}] is read-only; batch_get_into needs writable buffers")
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


class KVPoolClient:
    """A synchronous client of one KV pool. Not thread-safe: use one per thread, or ``AsyncKVPoolClient``.

    ``endpoints``: any agents of the pool (``host:port``); the rest are learned from them.
    ``token``: a credential: the namespace credential of this deployment (``daybreak credentials``),
    or the pool secret (admin, every namespace). ``namespace``: the deployment's kvNamespace; keys of different
    namespaces never collide. ``replicas``: copies written per block (default: the pool's setting).
    ``transport``: ``"auto"`` uses shared memory with same-node agents, ``"tcp"`` never does.
    ``transports``: the pool's allowed transports, most preferred first (its ``spec.transport.preference``;
    engine pods get it as ``DAYBREAK_TRANSPORTS``); default all. A data path not listed is never taken:
    without ``shm`` no agent's segments are mapped, and the engine is used for host buffers only when its
    first route is listed. An agent whose own list leaves shm out offers no mapping either. The store's
    stream (tcp) always carries the control and is the path when nothing listed applies.
    ``timeout_seconds``: socket timeout per request. ``verify``: check each block's CRC-32C on read.
    ``local_first``: write the first copy to this node's agent (the first endpoint reached through
    shared memory) and let the key's home record where it is; readers elsewhere follow that record.
    ``tls_ca_file``: speak TLS to the agents (started with ``--tls-cert``), checking their
    certificates against this CA bundle (docs/security.md has the cost).
    ``engine``: a transfer engine (``daybreak.agent.transfer.TransferEngine``, started; an engine pod builds
    it from its contract with ``daybreak.client.datapath.engine_for_pod``) to move bytes one-sided into the agents' registered segments (shm, link, rdma; ``daybreak.client.datapath``);
    needed for device-memory buffers (objects with ``device``, ``ptr``/``address`` and ``size``), which take per
    agent the device link into an HBM tier, one DMA into a same-node DRAM segment, RDMA (GPUDirect where a NIC
    shares the device's PCIe switch, else staged through pinned memory), and tcp staged last; the path each
    agent gets is logged once (``event=datapath``; ``daybreak.client.datapath`` has the order).
    Give the engine the same credential as ``token`` (``TransferEngine(token=...)``): the agents'
    engines admit a namespace credential and check, per request, the capability the agent granted
    for that block, so no pool secret is needed on the one-sided path.
    """

    def __init__(self, endpoints: Sequence[str], *, token: str, namespace: str, replicas: int | None = None,
                 transport: Literal["auto", "tcp"] = "auto", timeout_seconds: float = 30.0,
                 verify: bool = True, local_first: bool = True, tls_ca_file: str | None = None,
                 engine: DataEngine | None = None, transports: Sequence[str] | None = None) -> None:
        if not endpoints:
            raise ValueError("endpoints: give at least one agent address (host:port)")
        if not _NAMESPACE.fullmatch(namespace):
            raise ValueError(f"namespace {namespace!r} must match {_NAMESPACE.pattern}")
        if transport not in ("auto", "tcp"):
            raise ValueError(f"transport must be 'auto' or 'tcp', got {transport!r}")
        if replicas is not None and replicas < 1:
            raise ValueError(f"replicas must be at least 1, got {replicas}")
        allowed = tuple(transports) if transports is not None else ALL_TRANSPORTS
        unknown = [t for t in allowed if t not in ALL_TRANSPORTS]
        if unknown or not allowed:
            raise ValueError(f"transports: {unknown or 'empty'}: expected a non-empty subset of "
                             f"{', '.join(ALL_TRANSPORTS)} (the pool's spec.transport.preference)")
        try:
            scope, _ = credentials.parse(token)
        except credentials.CredentialError as exc:
            raise KVPoolAuthorizationError(str(exc)) from None
        if scope.role == credentials.NAMESPACE and scope.namespace != namespace:
            raise KVPoolAuthorizationError(
                f"not authorized: the credential is scoped to namespace {scope.namespace!r}, this client uses "
                f"{namespace!r}; use that deployment's credential (`daybreak credentials --namespace {namespace}`)")
        self._endpoints = list(endpoints)
        self._tls = client_context(ca_file=tls_ca_file) if tls_ca_file else None
        self._token = token.encode()
        self._prefix = namespace + "/"
        self._transport = transport
        self._allowed = allowed
        self._timeout = timeout_seconds
        self._verify = verify
        self._local_first = local_first
        self._conns: dict[str, Connection] = {}
        self._used: dict[str, float] = {}
        self._local: dict[str, bool] = {}
        self._down: dict[str, float] = {}
        self._maps: dict[str, ShmSegment] = {}
        self._backing: dict[str, Backing] = {}
        self._checker: ThreadPoolExecutor | None = None
        self._datapath = (EngineDataPath(engine, timeout_seconds=timeout_seconds, allowed=allowed)
                          if engine is not None else None)
        self._members: dict[str, str] = {}  # agent id -> address
        self._refreshed = 0.0
        self._refresh(force=True)
        first = next(iter(self._conns.values()))
        self.replicas = replicas or max(1, first.hello.replicas)

    # -- public API ---------------------------------------------------------------------------------

    def batch_put(self, keys: Sequence[str], buffers: Sequence[Any], *, pin_seconds: int = 0,
                  tier: Literal["dram", "hbm"] = "dram") -> list[int]:
        """Store ``buffers[i]`` under ``keys[i]``; returns the copies written per key (0 = not stored).

        ``pin_seconds`` soft-pins the blocks against eviction for that long (hot prefixes).
        ``tier="hbm"`` asks agents with an HBM tier to keep the blocks in device memory
        (others, or a full HBM tier, keep them in DRAM).
        """
        if tier not in ("dram", "hbm"):
            raise ValueError(f"tier must be 'dram' or 'hbm', got {tier!r}")
        self._check(keys, buffers)
        views = self._views(buffers, writable=False)
        checksums = [0 if isinstance(v, DeviceRef) else crc32c(v) for v in views]
        wire = [self._prefix + k for k in keys]
        copies = [0] * len(keys)
        tried: list[set[str]] = [set() for _ in keys]
        live = self._live()
        homes = [rank(k, live) for k in wire]
        local = self._local_agent(live) if self._local_first else None
        # Local-first: the first copy goes to this node's agent; the key's home records where it is.
        order = [[local, *(a for a in h if a != local)] if local and local not in h[:self.replicas] else h
                 for h in homes]
        for _ in range(max(len(live), 1)):
            groups: dict[tuple[str, bool], list[int]] = {}
            for i in range(len(keys)):
                need = self.replicas - copies[i]
                if need <= 0:
                    continue
                for agent in [a for a in order[i] if a not in tried[i] and not self._is_down(a)][:need]:
                    groups.setdefault((agent, agent != homes[i][0]), []).append(i)
                    tried[i].add(agent)
            if not groups:
                break
            for (agent, away), idxs in groups.items():
                for chunk in self._chunks(idxs, [len(v) for v in views]):
                    statuses = self._put_group(agent, [wire[i] for i in chunk], [views[i] for i in chunk],
                                               [checksums[i] for i in chunk], pin_seconds, tier,
                                               flags=p.FLAG_RECORD if away else 0)
                    for i, status in zip(chunk, statuses, strict=True):
                        if status == p.Status.OK:
                            copies[i] += 1
        return copies

    def batch_get_into(self, keys: Sequence[str], buffers: Sequence[Any]) -> list[int | None]:
        """Read each key into the start of ``buffers[i]``; returns the block's size in bytes, or None on a miss.

        Raises ValueError when a buffer is smaller than its stored block (after filling the others).
        """
        self._check(keys, buffers)
        views = self._views(buffers, writable=True)
        wire = [self._prefix + k for k in keys]
        results: list[int | None] = [None] * len(keys)
        too_small: list[str] = []
        live = self._live()
        order = [rank(k, live) for k in wire]
        tried: list[set[str]] = [set() for _ in keys]
        redirect: dict[int, str] = {}  # key index -> agent the home says holds it
        pending = list(range(len(keys)))
        for _ in range(max(len(live), 1) + 1):
            groups: dict[tuple[str, bool], list[int]] = {}
            for i in pending:
                target = redirect.pop(i, None)
                if target is not None and target not in tried[i] and not self._is_down(target):
                    groups.setdefault((target, False), []).append(i)
                    tried[i].add(target)
                    continue
                candidates = [a for a in order[i] if a not in tried[i] and not self._is_down(a)]
                if candidates:
                    # The first reachable agent in rank order is the key's home: it may pull the block in.
                    groups.setdefault((candidates[0], True), []).append(i)
                    tried[i].add(candidates[0])
            if not groups:
                break
            pending = []
            for (agent, home), idxs in groups.items():
                for chunk in self._chunks(idxs, [len(v) for v in views]):
                    got = self._get_group(agent, [wire[i] for i in chunk], [views[i] for i in chunk],
                                          flags=p.FLAG_PULL if home else 0)
                    if got is None:
                        pending += chunk  # agent unreachable: ask the next replica
                        continue
                    infos, verified = got
                    bad: list[str] = []
                    for j, (i, info) in enumerate(zip(chunk, infos, strict=True)):
                        if info.status == p.Status.CORRUPT or (
                                info.status == p.Status.OK and self._verify and j not in verified
                                and crc32c(views[i][:info.size]) != info.checksum):
                            bad.append(wire[i])
                            pending.append(i)
                        elif info.status == p.Status.OK:
                            results[i] = info.size
                        elif info.status == p.Status.TOO_SMALL:
                            too_small.append(f"{keys[i]!r} needs {info.size} bytes, buffers[{i}] has {len(views[i])}")
                        elif info.status == p.Status.REDIRECT and info.where:
                            redirect[i] = self._agent_at(info.where)
                            pending.append(i)
                    if bad:
                        log.warning("event=checksum_mismatch agent=%s keys=%d action=reported", agent, len(bad))
                        self._call(agent, lambda c, bad=bad: c.report(bad))
        if too_small:
            raise ValueError("buffer too small for stored block: " + "; ".join(too_small))
        return results

    def batch_exists(self, keys: Sequence[str]) -> list[bool]:
        """Whether each key is held by some live agent."""
        wire = [self._prefix + k for k in keys]
        live = self._live()
        found = [False] * len(keys)
        for position in range(len(live)):
            groups: dict[str, list[int]] = {}
            for i, k in enumerate(wire):
                if not found[i]:
                    groups.setdefault(rank(k, live)[position], []).append(i)
            if not groups:
                break
            for agent, idxs in groups.items():
                infos = self._call(agent, lambda c, idxs=idxs: c.exists([wire[i] for i in idxs]))
                for i, info in zip(idxs, infos or [], strict=False):
                    found[i] = found[i] or info.status == p.Status.OK
        return found

    def remove(self, keys: Sequence[str]) -> list[bool]:
        """Remove keys from every live agent; True where some copy was removed."""
        wire = [self._prefix + k for k in keys]
        removed = [False] * len(keys)
        for agent in self._live():
            infos = self._call(agent, lambda c: c.remove(wire))
            for i, info in enumerate(infos or []):
                removed[i] = removed[i] or info.status == p.Status.OK
        return removed

    def flush_namespace(self, namespace: str) -> int:
        """Delete every block of ``namespace`` from every live agent; returns the bytes freed, summed.

        Needs the pool secret (any namespace) or ``namespace``'s own credential. Raises
        KVPoolAuthorizationError when the credential does not allow it, KVPoolError naming the agents
        that could not be flushed (their blocks age out instead); a retry flushes what is left."""
        if not _NAMESPACE.fullmatch(namespace):
            raise ValueError(f"namespace {namespace!r} must match {_NAMESPACE.pattern}")
        self._refresh(force=True)
        freed = 0
        failed = []
        for agent in list(self._members):
            try:
                freed += self._connect(agent).flush_namespace(namespace).bytes_freed
            except KVPoolError:
                raise
            except RemoteError as exc:
                self._conns.pop(agent, None)
                if "not authorized" in str(exc):
                    raise KVPoolAuthorizationError(str(exc)) from None
                failed.append(f"{self._members.get(agent, agent)}: {exc}")
            except (OSError, p.ProtocolError) as exc:
                self._mark_down(agent, str(exc) or type(exc).__name__)
                failed.append(f"{self._members.get(agent, agent)}: {exc}")
        if failed:
            raise KVPoolError(f"flush of {namespace} freed {freed} bytes but failed on: " + "; ".join(failed))
        return freed

    def members(self) -> list[str]:
        """Addresses of the live agents this client currently places keys on."""
        return [self._members[a] for a in self._live()]

    def close(self) -> None:
        """Close connections and unmap shared segments (and unregister what the client registered with the engine)."""
        if self._datapath is not None:
            self._datapath.close()
        for conn in self._conns.values():
            conn.close()
        self._conns.clear()
        for seg in self._maps.values():
            with contextlib.suppress(BufferError):
                seg.close()
        self._maps.clear()
        self._backing.clear()
        if self._checker is not None:
            self._checker.shutdown(wait=True)
            self._checker = None

    def __enter__(self) -> KVPoolClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- membership and connections ----------------------------------------------------------------

    def _views(self, buffers: Sequence[Any], *, writable: bool) -> list[Any]:
        """Host buffers as byte views, device buffers as DeviceRefs (those need an engine)."""
        out: list[Any] = []
        for i, b in enumerate(buffers):
            ref = device_ref(b)
            if ref is None:
                out.append(_view(b, i, writable=writable))
            elif self._datapath is None:
                raise ValueError(f"buffers[{i}] is device memory: pass engine= (a started TransferEngine) to the "
                                 "client to move device buffers")
            else:
                out.append(ref)
        return out

    @staticmethod
    def _check(keys: Sequence[str], buffers: Sequence[Any]) -> None:
        if len(keys) != len(buffers):
            raise ValueError(f"keys ({len(keys)}) and buffers ({len(buffers)}) differ in length")
        for i, k in enumerate(keys):
            if not isinstance(k, str) or not k:
                raise ValueError(f"keys[{i}] must be a non-empty str")

    @staticmethod
    def _chunks(idxs: list[int], sizes: list[int]) -> list[list[int]]:
        out: list[list[int]] = [[]]
        total = 0
        for i in idxs:
            if out[-1] and (len(out[-1]) >= _MAX_BATCH_KEYS or total + sizes[i] > _MAX_BATCH_BYTES):
                out.append([])
                total = 0
            out[-1].append(i)
            total += sizes[i]
        return out

    def _local_agent(self, live: list[str]) -> str | None:
        """This node's agent: the first endpoint given that shares our /dev/shm."""
        for endpoint in self._endpoints:
            agent = self._agent_at(endpoint)
            if agent in live and not self._is_down(agent):
                self._connect_quietly(agent)
                if self._local.get(agent):
                    return agent
        return None

    def _agent_at(self, address: str) -> str:
        for agent, addr in self._members.items():
            if addr == address:
                return agent
        return address

    def _is_down(self, agent: str) -> bool:
        until = self._down.get(agent)
        return until is not None and until > time.monotonic()

    def _mark_down(self, agent: str, reason: str) -> None:
        log.info("event=agent_unavailable agent=%s reason=%s", agent, reason)
        self._down[agent] = time.monotonic() + _DOWN_SECONDS
        if self._datapath is not None:
            self._datapath.forget(agent)  # a restarted agent registers new segments
        conn = self._conns.pop(agent, None)
        if conn is not None:
            conn.close()
        self._refreshed = 0.0  # ask the pool who is live at the next call

    def _connect(self, agent: str) -> Connection:
        conn = self._conns.get(agent)
        now = time.monotonic()
        if conn is not None and now - self._used.get(agent, now) > _MAX_IDLE_SECONDS:
            conn.close()  # the agent may have closed it as idle: open a fresh one instead of failing a request
            del self._conns[agent]
            conn = None
        self._used[agent] = now
        if conn is not None:
            return conn
        address = self._members.get(agent, agent)
        try:
            conn = Connection(address, token=self._token, timeout_seconds=self._timeout, tls=self._tls)
        except (RemoteError, AuthenticationFailed) as exc:
            raise KVPoolError(f"agent {address} refused the client: {exc}") from None
        self._conns[agent] = conn
        self._local[agent] = self._transport == "auto" and "shm" in self._allowed and self._probe(conn)
        # A restarted agent may have new segments: drop mappings from before.
        prefix = conn.hello.shm_probe.removesuffix("-probe")
        for name in [n for n in self._maps if prefix and n.startswith(prefix)]:
            self._backing.pop(name, None)
            with contextlib.suppress(BufferError):
                self._maps.pop(name).close()
        return conn

    def _probe(self, conn: Connection) -> bool:
        """True when this process maps the agent's /dev/shm (same node): the probe segment holds its nonce."""
        if not conn.hello.shm_probe:  # the agent offers no shm (its transports leave it out)
            return False
        try:
            seg = ShmSegment.attach(conn.hello.shm_probe)
        except (OSError, ValueError):
            return False
        try:
            return bytes(seg.buffer[:len(conn.hello.shm_nonce)]) == conn.hello.shm_nonce
        finally:
            with contextlib.suppress(BufferError):
                seg.close()

    def _refresh(self, *, force: bool = False) -> None:
        if not force and time.monotonic() - self._refreshed < 1.0:
            return
        errors = []
        sources = list(self._conns) + [e for e in self._endpoints if e not in self._conns]
        for agent in sources:
            try:
                conn = self._connect(agent)
                members = conn.members()
            except KVPoolError:
                raise
            except (OSError, p.ProtocolError, RemoteError) as exc:
                errors.append(f"{agent}: {exc}")
                self._conns.pop(agent, None)
                continue
            if conn.address != conn.hello.agent_id and agent in self._conns:
                # Key connections by agent id from now on.
                self._conns[conn.hello.agent_id] = self._conns.pop(agent)
                self._local[conn.hello.agent_id] = self._local.pop(agent, False)
            self._members = {m.agent_id: m.address for m in members if m.state == 0}
            self._refreshed = time.monotonic()
            return
        if force or not self._members:
            raise KVPoolError("no agent of the pool is reachable: " + "; ".join(errors))

    def _live(self) -> list[str]:
        self._refresh()
        live = [a for a in self._members if not self._is_down(a)]
        return live or list(self._members)

    def _call(self, agent: str, fn: Any) -> Any:
        """Run ``fn(connection)``; None (and the agent marked down for a moment) if it fails."""
        try:
            return fn(self._connect(agent))
        except KVPoolError:
            raise
        except RemoteError as exc:
            if "not authorized" in str(exc):
                self._conns.pop(agent, None)
                raise KVPoolAuthorizationError(str(exc)) from None
            if "quota exceeded" in str(exc):  # the agent is fine and the connection still open: not a failover
                raise KVPoolQuotaError(str(exc)) from None
            self._mark_down(agent, str(exc) or type(exc).__name__)
            return None
        except (OSError, p.ProtocolError) as exc:
            self._mark_down(agent, str(exc) or type(exc).__name__)
            return None

    # -- data paths ---------------------------------------------------------------------------------

    def _segment(self, name: str) -> ShmSegment:
        seg = self._maps.get(name)
        if seg is None:
            seg = self._maps[name] = ShmSegment.attach(name)
            self._backing[name] = Backing(seg)
        return seg

    def _in_order(self, items: list[tuple[Backing, int, int, Any]], *, write: bool, work: Any,
                  split: bool = False) -> None:
        """``work(payload)`` for each ``(backing, offset, size, payload)`` in order, once its windows are mapped.

        Mapping a window of an agent's segment the first time (one madvise per 2 MiB) costs this
        process about half a copy of it. When a batch's blocks touch more than a window's worth
        of bytes not mapped yet, a helper thread maps them in order, ahead of the copies, so mapping block k+1
        overlaps copying block k (the filler works ahead of the frontier); madvise and the copies
        release the GIL. Warm batches run inline: no hand-off. Only the windows the batch touches
        are mapped, so a client of an agent still backing its tier never waits for the whole segment.
        """
        cold = sum(size for b, off, size, _ in items if not b.backed(off, size, write=write))
        if cold < 2 * BACKING_WINDOW:  # a window or less to map (small blocks share one): not worth a hand-off
            def run(part: list[tuple[Backing, int, int, Any]]) -> None:
                for b, off, size, payload in part:
                    b.ensure(off, size, write=write)
                    work(payload)

            if split and len(items) > 1:  # ``work`` releases the GIL: the helper takes every other block
                helper = self._helper().submit(run, items[1::2])
                try:
                    run(items[0::2])
                finally:
                    helper.result()
            else:
                run(items)
            return
        ready = [threading.Event() for _ in items]

        def mapper() -> None:
            try:
                for (b, off, size, _), event in zip(items, ready, strict=True):
                    b.ensure(off, size, write=write)
                    event.set()
            finally:
                for event in ready:  # never leave the copying thread waiting
                    event.set()

        helper = self._helper().submit(mapper)
        try:
            for (_, _, _, payload), event in zip(items, ready, strict=True):
                event.wait()
                work(payload)
        finally:
            helper.result()

    def _helper(self) -> ThreadPoolExecutor:
        if self._checker is None:
            self._checker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvpool-helper")
        return self._checker

    def _put_group(self, agent: str, keys: list[str], views: list[memoryview], checksums: list[int],
                   pin_seconds: int, tier: str, *, flags: int = 0) -> list[p.Status | None]:
        def tcp(conn: Connection) -> list[p.Status]:
            return [i.status for i in conn.put(keys, views, checksums, pin_seconds=pin_seconds,
                                               tier=1 if tier == "hbm" else 0, flags=flags)]

        def shm(conn: Connection) -> list[p.Status]:
            reply = conn.alloc(keys, [len(v) for v in views], checksums, pin_seconds=pin_seconds)
            try:
                targets = [(self._segment(info.where), info.offset, view) for info, view in
                           zip(reply.blocks, views, strict=True) if info.status == p.Status.OK]

                def store(item: tuple[ShmSegment, int, memoryview]) -> None:
                    seg, offset, view = item
                    seg.buffer[offset:offset + len(view)] = view

                self._in_order([(self._backing[t[0].name], t[1], len(t[2]), t) for t in targets], write=True,
                               work=store)
            except BaseException:
                conn.commit(reply.lease_id, abort=True)
                raise
            committed = conn.commit(reply.lease_id, flags=flags)
            if len(committed) != len(reply.blocks):  # the reservation expired (or was never ours): not stored
                return [p.Status.MISS] * len(keys)
            return [i.status if c.status == p.Status.OK else c.status
                    for i, c in zip(reply.blocks, committed, strict=True)]

        def engine(conn: Connection) -> list[p.Status]:
            assert self._datapath is not None
            got = self._datapath.put(agent, conn, keys, views, checksums, tier=1 if tier == "hbm" else 0,
                                     pin_seconds=pin_seconds, flags=flags)
            if got is None:  # a transfer failed: the stream (device buffers staged through pinned memory)
                return staged(conn, self._datapath.failure) if device else tcp(conn)
            return got

        def staged(conn: Connection, reason: str = "no_segments") -> list[p.Status]:
            assert self._datapath is not None  # device buffers need an engine (_views)
            return self._datapath.stream_put(agent, conn, keys, views, tier=1 if tier == "hbm" else 0,
                                             pin_seconds=pin_seconds, flags=flags, reason=reason)

        self._connect_quietly(agent)
        device = any(isinstance(v, DeviceRef) for v in views)
        strategy = self._strategy(agent, device=device)
        # Shared memory reaches the DRAM tier only; HBM blocks travel through the agent or the engine.
        statuses = self._call(agent, engine if strategy is Strategy.ENGINE else staged if device else
                              shm if self._local.get(agent) and tier == "dram" else tcp)
        if statuses is None:
            return [None] * len(keys)
        if p.Status.LEAVING in statuses:
            self._mark_down(agent, "leaving")
        return list(statuses)

    def _get_group(self, agent: str, keys: list[str], views: list[memoryview], *,
                   flags: int) -> tuple[list[p.BlockInfo], set[int]] | None:
        """Fetch one agent's share; returns the infos and the indices already verified here."""
        def tcp(conn: Connection) -> tuple[list[p.BlockInfo], set[int]]:
            return conn.get_into(keys, views, flags=flags), set()

        def shm(conn: Connection) -> tuple[list[p.BlockInfo], set[int]]:
            reply = conn.locate(keys, flags=flags)
            copies: list[tuple[int, memoryview, memoryview, Backing, int]] = []
            fallback = []
            try:
                for i, (info, view) in enumerate(zip(reply.blocks, views, strict=True)):
                    if info.status != p.Status.OK:
                        continue
                    if info.size > len(view):
                        info.status = p.Status.TOO_SMALL
                    elif not info.where:
                        fallback.append(i)
                    else:
                        seg = self._segment(info.where)
                        copies.append((i, view[:info.size], seg.buffer[info.offset:info.offset + info.size],
                                       self._backing[info.where], info.offset))
                checked = self._copy_all(copies)
            finally:
                conn.release(reply.lease_id)
            verified = set()
            for i, crc in checked.items():
                if crc is None:
                    continue
                if crc == reply.blocks[i].checksum:
                    verified.add(i)
                else:
                    reply.blocks[i].status = p.Status.CORRUPT
            if fallback:
                got = conn.get_into([keys[i] for i in fallback], [views[i] for i in fallback])
                for i, info in zip(fallback, got, strict=True):
                    reply.blocks[i] = info
            return reply.blocks, verified

        def engine(conn: Connection) -> tuple[list[p.BlockInfo], set[int]]:
            assert self._datapath is not None
            got = self._datapath.get(agent, conn, keys, views, flags=flags, verify=self._verify)
            return got if got is not None else tcp(conn)

        def staged(conn: Connection) -> tuple[list[p.BlockInfo], set[int]]:
            assert self._datapath is not None  # device buffers need an engine (_views)
            return self._datapath.stream_get(agent, conn, keys, views, flags=flags, reason="no_segments")

        self._connect_quietly(agent)
        device = any(isinstance(v, DeviceRef) for v in views)
        strategy = self._strategy(agent, device=device)
        result = self._call(agent, engine if strategy is Strategy.ENGINE else staged if device else
                            shm if self._local.get(agent) else tcp)
        return None if result is None else (list(result[0]), result[1])

    def _strategy(self, agent: str, *, device: bool) -> Strategy:
        """How bytes move to and from ``agent`` (``daybreak.client.datapath``): engine, memcpy or stream."""
        if self._datapath is not None and (self._transport == "auto" or device):
            conn = self._conns.get(agent)
            if conn is not None:
                try:
                    strategy = self._datapath.choose(agent, conn, device=device)
                except (OSError, p.ProtocolError, RemoteError) as exc:
                    log.info("event=engine_segments_unavailable agent=%s reason=%s", agent, exc)
                else:
                    if strategy is not Strategy.ENGINE:
                        self._datapath.note_path(agent, "memcpy" if self._local.get(agent) else "stream",
                                                 "host buffers; the engine's first route to the agent is not "
                                                 "one-sided or not allowed")
                    return strategy
        return Strategy.MEMCPY if self._local.get(agent) else Strategy.STREAM

    def _copy_all(self, copies: list[tuple[int, memoryview, memoryview, Backing, int]]) -> dict[int, int | None]:
        """Copy blocks ``(index, dst, src, backing, offset)`` out of mapped segments, checksumming what the caller gets.

        The CRC always covers the caller's buffer (``copy_crc32c``: what the caller gets is what
        is checked, whatever the segment holds meanwhile). With the fused kernel it is one pass
        over the block, about the cost of the copy alone; without it, a copy then a CRC of the
        cache-hot copy. The segment's windows are mapped ahead of the copies (``_in_order``), and a
        warm batch of at least ``_SPLIT_BYTES`` is split between this thread and one helper thread:
        both kernels release the GIL, and one thread's copy reaches only about 0.7 of the machine's
        memcpy (measured 0.39-0.45 of a one-thread memcpy for 16 x 1 MiB, 0.68-0.71 split).
        """
        out: dict[int, int | None] = {}
        verify = self._verify

        def copy(item: tuple[int, memoryview, memoryview]) -> None:
            i, dst, src = item
            n = len(src)
            if verify:
                out[i] = copy_crc32c(dst, src)
                return
            if n:
                ctypes.memmove((ctypes.c_char * n).from_buffer(dst), (ctypes.c_char * n).from_buffer(src), n)
            out[i] = None

        self._in_order([(b, off, len(src), (i, dst, src)) for i, dst, src, b, off in copies], write=False,
                       work=copy, split=sum(len(c[2]) for c in copies) >= _SPLIT_BYTES)
        return out

    def _connect_quietly(self, agent: str) -> None:
        with contextlib.suppress(OSError, p.ProtocolError, RemoteError):
            self._connect(agent)
