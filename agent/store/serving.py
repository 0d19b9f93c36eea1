"""Serving store connections: the handshake, then one request after another through a handler table.

One thread per connection with blocking sockets: ``recv_into`` and
``sendmsg`` release the GIL, so bytes move at socket speed while the index
work stays short under the store's lock. A connection that sends a bad token,
a malformed or oversized frame is closed with a logged reason; no other
connection notices. ``HANDLERS`` maps every request op to one method; an op
without a handler (REPLY, ERROR, a second HELLO) is a protocol error.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from daybreak.agent.store.engine import BlockStore, Reservation
from daybreak.agent.store.handoff import HandOff
from daybreak.agent.store.peers import Membership
from daybreak.agent.store.pullthrough import PullThrough
from daybreak.agent.store.records import Records
from daybreak.pool import protocol as p
from daybreak.pool.handshake import AuthenticationFailed, Hello, server_accept
from daybreak.pool.sockets import discard, recv_exact_into, send_all

log = logging.getLogger(__name__)

Handler = Callable[[socket.socket, p.Header, object], None]


@dataclass(frozen=True)
class Welcome:
    """What this agent tells every client after the handshake (``HelloReply``)."""

    pool: str
    shm_probe: str
    shm_nonce: bytes
    lease_seconds: int
    replicas: int


class Service:
    """Answers requests on accepted connections against one ``BlockStore`` and the pool machinery."""

    def __init__(self, *, store: BlockStore, token: bytes, welcome: Welcome, membership: Membership,
                 handoff: HandOff, records: Records, pull: PullThrough) -> None:
        self.store = store
        self.token = token
        self.welcome = welcome
        self.membership = membership
        self.handoff = handoff
        self.records = records
        self.pull = pull
        self.closed = threading.Event()
        self._conns: set[socket.socket] = set()
        self._conns_lock = threading.Lock()
        self.handlers: dict[p.Op, Handler] = {
            p.Op.PUT: self._put,
            p.Op.GET: self._get,
            p.Op.LOCATE: self._locate,
            p.Op.EXISTS: self._exists,
            p.Op.REMOVE: self._remove,
            p.Op.REPORT: self._report,
            p.Op.RELEASE: self._release,
            p.Op.ALLOC: self._alloc,
            p.Op.COMMIT: self._commit,
            p.Op.RECORD: self._record,
            p.Op.MEMBERS: self._members,
            p.Op.PING: self._ping,
            p.Op.STATS: self._stats,
        }

    @property
    def agent_id(self) -> str:
        return self.membership.agent_id

    # -- connections ------------------------------------------------------------------------------

    def accept_loop(self, sock: socket.socket) -> None:
        while not self.closed.is_set():
            try:
                conn, peer = sock.accept()
            except OSError:
                if self.closed.is_set():
                    return
                continue
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            t = threading.Thread(target=self.serve, args=(conn, f"{peer[0]}:{peer[1]}"), daemon=True,
                                 name="store-conn")
            t.start()

    def shutdown_connections(self) -> None:
        with self._conns_lock:
            for conn in list(self._conns):
                with contextlib.suppress(OSError):
                    conn.shutdown(socket.SHUT_RDWR)

    def serve(self, conn: socket.socket, peer: str) -> None:
        with self._conns_lock:
            self._conns.add(conn)
        try:
            conn.settimeout(30.0)  # a client that stalls inside the handshake is dropped
            channel = _HelloChannel(conn, self._error)
            try:
                server_accept(channel, token=self.token)
            except AuthenticationFailed:
                self.store.metrics.rejected.labels(reason="auth").inc()
                log.warning("event=connection_refused agent=%s peer=%s reason=wrong_token", self.agent_id, peer)
                return
            w = self.welcome
            reply = p.HelloReply(self.agent_id, w.pool, w.shm_probe, w.shm_nonce, w.lease_seconds, w.replicas).encode()
            send_all(conn, p.frame(p.Op.REPLY, reply, request_id=channel.request_id))
            conn.settimeout(None)
            while not self.closed.is_set():
                try:
                    header, meta = p.read_frame(conn)
                except ConnectionError:
                    return
                started = time.perf_counter()
                self.dispatch(conn, header, meta)
                self.store.metrics.latency.labels(op=header.op.name.lower()).observe(time.perf_counter() - started)
        except p.ProtocolError as exc:
            self.store.metrics.rejected.labels(reason="protocol").inc()
            log.warning("event=connection_closed agent=%s peer=%s reason=%r", self.agent_id, peer, str(exc))
        except (ConnectionError, TimeoutError, OSError) as exc:
            log.debug("event=connection_lost agent=%s peer=%s reason=%s", self.agent_id, peer, exc)
        finally:
            with self._conns_lock:
                self._conns.discard(conn)
            conn.close()

    def dispatch(self, conn: socket.socket, header: p.Header, meta: bytearray) -> None:
        handler = self.handlers.get(header.op)
        if handler is None:  # REPLY, ERROR and HELLO are never requests
            raise p.ProtocolError(f"unexpected {header.op.name} frame from a client")
        request = p.decode_request(header.op, meta)
        if header.op != p.Op.PUT and header.data_len:
            raise p.ProtocolError(f"{header.op.name} carries no data section, got {header.data_len} bytes")
        handler(conn, header, request)

    def _error(self, conn: socket.socket, rid: int, text: str) -> None:
        with contextlib.suppress(OSError):
            send_all(conn, p.frame(p.Op.ERROR, p.TextReply(text).encode(), request_id=rid))

    def _reply(self, conn: socket.socket, rid: int, meta: bytes, data: list[memoryview] | None = None) -> None:
        total = sum(len(d) for d in data or [])
        send_all(conn, [*p.frame(p.Op.REPLY, meta, request_id=rid, data_len=total), *(data or [])])

    def _blocks(self, conn: socket.socket, header: p.Header, infos: list[p.BlockInfo], *, lease_id: int = 0) -> None:
        self._reply(conn, header.request_id, p.BlocksReply(infos, lease_id).encode())

    def _redirect_or_miss(self, key: str) -> p.BlockInfo:
        holder = self.records.pointer(key)
        return p.BlockInfo(p.Status.REDIRECT, where=holder) if holder else p.BlockInfo(p.Status.MISS)

    # -- handlers: writes ---------------------------------------------------------------------------

    def _put(self, conn: socket.socket, header: p.Header, request: object) -> None:
        assert isinstance(request, p.PutRequest)
        req = request
        if header.data_len != sum(req.sizes):
            raise p.ProtocolError(f"PUT data section is {header.data_len} bytes, sizes add up to {sum(req.sizes)}")
        tier = "hbm" if req.tier == 1 else "dram"
        with self.handoff.admitting(replica=bool(header.flags & p.FLAG_REPLICA)) as refused:
            slots = [] if refused else [self.store.reserve(k, s, c, tier=tier, pin_seconds=req.pin_seconds)
                                        for k, s, c in zip(req.keys, req.sizes, req.checksums, strict=True)]
        if refused:
            discard(conn, header.data_len)
            self._blocks(conn, header, [p.BlockInfo(p.Status.LEAVING) for _ in req.keys])
            return
        reserved = [s for s in slots if isinstance(s, Reservation)]
        self.store.back(slots)
        try:
            for slot, size in zip(slots, req.sizes, strict=True):
                if not isinstance(slot, Reservation):
                    discard(conn, size)
                else:
                    target = self.store.write_buffer(slot)
                    recv_exact_into(conn, target)
                    self.store.finish_write(slot, target)
        except BaseException:
            self.store.commit(reserved, ok=False)
            raise
        self.store.commit(reserved)
        if header.flags & p.FLAG_RECORD and reserved:
            self.records.send_later([r.key for r in reserved])
        infos = [p.BlockInfo(p.Status.OK, s.size, s.checksum) if isinstance(s, Reservation) else p.BlockInfo(s)
                 for s in slots]
        self._blocks(conn, header, infos)

    def _alloc(self, conn: socket.socket, header: p.Header, request: object) -> None:
        assert isinstance(request, p.AllocRequest)
        req = request
        with self.handoff.admitting() as refused:
            slots = [] if refused else [self.store.reserve(k, s, c, pin_seconds=req.pin_seconds)
                                        for k, s, c in zip(req.keys, req.sizes, req.checksums, strict=True)]
        if refused:
            self._blocks(conn, header, [p.BlockInfo(p.Status.LEAVING) for _ in req.keys])
            return
        self.store.back(slots)
        parked: list[Reservation | None] = [s if isinstance(s, Reservation) else None for s in slots]
        rid_parked = self.store.park(parked)
        infos = [p.BlockInfo(p.Status.OK, s.size, s.checksum, *self.store.location(s))
                 if isinstance(s, Reservation) else p.BlockInfo(s) for s in slots]
        self._blocks(conn, header, infos, lease_id=rid_parked)

    def _commit(self, conn: socket.socket, header: p.Header, request: object) -> None:
        assert isinstance(request, p.LeaseRequest)
        parked = self.store.unpark(request.lease_id) or []
        done = [r for r in parked if r is not None]
        self.store.commit(done, ok=not header.flags & p.FLAG_ABORT)
        if header.flags & p.FLAG_RECORD and not header.flags & p.FLAG_ABORT and done:
            self.records.send_later([r.key for r in done])
        self._blocks(conn, header, [p.BlockInfo(p.Status.OK if r else p.Status.MISS) for r in parked])

    def _remove(self, conn: socket.socket, header: p.Header, request: object) -> None:
        assert isinstance(request, p.KeysRequest)
        statuses = self.store.remove(request.keys)
        self.records.forget(request.keys)
        self._blocks(conn, header, [p.BlockInfo(s) for s in statuses])

    # -- handlers: reads ----------------------------------------------------------------------------

    def _get(self, conn: socket.socket, header: p.Header, request: object) -> None:
        assert isinstance(request, p.KeysRequest)
        req = request
        if header.flags & p.FLAG_PULL:
            self.pull.pull(req.keys)
        blocks = self.store.acquire(req.keys)
        try:
            infos: list[p.BlockInfo] = []
            data: list[memoryview] = []
            for i, block in enumerate(blocks):
                if block is None:
                    infos.append(self._redirect_or_miss(req.keys[i]))
                elif req.capacities and block.size > req.capacities[i]:
                    infos.append(p.BlockInfo(p.Status.TOO_SMALL, block.size, block.checksum))
                else:
                    infos.append(p.BlockInfo(p.Status.OK, block.size, block.checksum))
                    data.append(self.store.read_view(block))
            self._reply(conn, header.request_id, p.BlocksReply(infos).encode(), data)
        finally:
            self.store.release(blocks)

    def _locate(self, conn: socket.socket, header: p.Header, request: object) -> None:
        assert isinstance(request, p.KeysRequest)
        req = request
        if header.flags & p.FLAG_PULL:
            self.pull.pull(req.keys)
        blocks = self.store.acquire(req.keys, count=False)
        infos: list[p.BlockInfo] = []
        for key, block in zip(req.keys, blocks, strict=True):
            where, offset = self.store.location(block) if block is not None else ("", 0)
            if block is None or where:
                self.store.record(block)  # others are counted by the GET that fetches them
            if block is None:
                infos.append(self._redirect_or_miss(key))
            else:
                # where == '': not mappable from another process, the client falls back to GET for it
                infos.append(p.BlockInfo(p.Status.OK, block.size, block.checksum, where, offset))
        lease_id = self.store.lease(blocks)
        self._blocks(conn, header, infos, lease_id=lease_id)

    def _exists(self, conn: socket.socket, header: p.Header, request: object) -> None:
        assert isinstance(request, p.KeysRequest)
        infos = [p.BlockInfo(p.Status.OK, b.size, b.checksum) if b else p.BlockInfo(p.Status.MISS)
                 for b in self.store.exists(request.keys)]
        self._blocks(conn, header, infos)

    def _report(self, conn: socket.socket, header: p.Header, request: object) -> None:
        assert isinstance(request, p.KeysRequest)
        infos = [p.BlockInfo(p.Status.CORRUPT if self.store.drop_corrupt(k) else p.Status.OK) for k in request.keys]
        self._blocks(conn, header, infos)

    def _release(self, conn: socket.socket, header: p.Header, request: object) -> None:
        assert isinstance(request, p.LeaseRequest)
        self.store.end_lease(request.lease_id)  # one-way: no reply

    # -- handlers: the pool ---------------------------------------------------------------------------

    def _record(self, conn: socket.socket, header: p.Header, request: object) -> None:
        assert isinstance(request, p.RecordRequest)
        self.records.note(request.holder, request.keys)
        self._blocks(conn, header, [p.BlockInfo(p.Status.OK) for _ in request.keys])

    def _members(self, conn: socket.socket, header: p.Header, request: object) -> None:
        self._reply(conn, header.request_id, p.MembersReply(self.membership.members()).encode())

    def _ping(self, conn: socket.socket, header: p.Header, request: object) -> None:
        assert isinstance(request, p.MembersReply)
        for member in request.members[:1]:
            self.membership.heard(member)
        self._reply(conn, header.request_id, p.MembersReply(self.membership.members()).encode())

    def _stats(self, conn: socket.socket, header: p.Header, request: object) -> None:
        counts = {**self.store.stats(), "rss_bytes": _rss_bytes(), "rss_peak_bytes": _peak_rss_bytes(),
                  "peers_live": len(self.membership.live_ids()) - 1, "pointers": len(self.records)}
        text = "\n".join(f"{k}={v}" for k, v in counts.items())
        self._reply(conn, header.request_id, p.TextReply(text).encode())


class _HelloChannel:
    """The store protocol's side of ``pool.handshake.ServerChannel``: the first frame must be a HELLO."""

    def __init__(self, conn: socket.socket, error: Callable[[socket.socket, int, str], None]) -> None:
        self._conn = conn
        self._error = error
        self.request_id = 0

    def recv_hello(self) -> Hello:
        header, meta = p.read_frame(self._conn)
        if header.op != p.Op.HELLO:
            raise p.ProtocolError(f"first frame is {header.op.name}, expected HELLO")
        self.request_id = header.request_id
        hello = p.Hello.decode(meta)
        if header.data_len:  # a HELLO has no data section: refused like a wrong token
            self.send_refusal("wrong pool token")
            raise AuthenticationFailed("HELLO frame with a data section")
        return Hello(hello.token, hello.client)

    def send_refusal(self, reason: str) -> None:
        self._error(self._conn, self.request_id, f"authentication failed: {reason}")


def _rss_bytes() -> int:
    """Resident set size of this process (includes the shared-memory pages it has touched)."""
    try:
        with open(f"/proc/{os.getpid()}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


def _peak_rss_bytes() -> int:
    """High-water mark of the resident set (VmHWM)."""
    try:
        with open(f"/proc/{os.getpid()}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0
