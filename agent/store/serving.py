"""Serving store connections: the handshake, then one request after another through a handler table.

One thread per connection with blocking sockets: ``recv_into`` and
``sendmsg`` release the GIL, so bytes move at socket speed while the index
work stays short under the store's lock. A connection that fails the
handshake, sends a malformed or oversized frame, or asks for something outside
its credential's scope is closed with a logged reason; no other connection
notices. Every wait has a deadline (handshake, idle, request body, reply) and
connections are capped per agent and per address (``Limits``, through ``pool.admission``,
as the transfer engine's server is), and per namespace credential once authenticated. Before
a request that leases, reserves or pins is handled, ``_admit_quotas`` asks the store whether
the key's namespace may hold that much more (``engine.Quotas``); a refusal is an ERROR frame
starting ``quota exceeded`` and the connection stays open. ``HANDLERS`` maps every request op
to one method; an op without a handler (REPLY, ERROR, a second HELLO) is a protocol error.
"""

from __future__ import annotations

import contextlib
import functools
import ipaddress
import logging
import os
import socket
import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from daybreak.agent.store.engine import BlockStore, QuotaExceeded, Reservation
from daybreak.agent.store.handoff import HandOff
from daybreak.agent.store.peers import Membership
from daybreak.agent.store.pullthrough import PullThrough
from daybreak.agent.store.records import Records
from daybreak.errors import DaybreakError
from daybreak.pool import credentials
from daybreak.pool import protocol as p
from daybreak.pool.admission import Admission, Caps
from daybreak.pool.checksum import crc32c
from daybreak.pool.credentials import Scope
from daybreak.pool.handshake import AuthenticationFailed, Challenge, Hello, server_accept
from daybreak.pool.sockets import discard, recv_exact, recv_exact_into, send_all, until

log = logging.getLogger(__name__)

Handler = Callable[[socket.socket, p.Header, object], None]

# Ops only pool peers (agent credential or the pool secret) may send: they shape membership and placement.
PEER_OPS = frozenset({p.Op.PING, p.Op.RECORD})
_WIRE_BYTES_PER_SECOND = 16 << 20  # the slowest peer a request's deadline allows for, on top of io_seconds


class NotAuthorized(DaybreakError):
    """A request outside the connection's scope: answered with an ERROR frame, then the connection is closed."""


@dataclass(frozen=True)
class Welcome:
    """What this agent tells every client after the handshake (``HelloReply``)."""

    pool: str
    shm_probe: str
    shm_nonce: bytes
    lease_seconds: int
    replicas: int


@dataclass(frozen=True)
class Limits:
    """Bounds on what one client can hold (docs/security.md: each one is a control there)."""

    handshake_seconds: float = 10.0       # one deadline for the whole handshake
    idle_seconds: float = 300.0           # an authenticated connection with no request for this long is closed
    io_seconds: float = 30.0              # a request's body and its reply get this (plus size / 16 MiB/s)
    max_connections: int = 1024           # per agent, authenticated or not
    max_connections_per_address: int = 256
    max_preauth: int = 256                # connections inside the handshake; the oldest is dropped for a new one
    max_preauth_per_address: int = 64
    max_reserved_bytes: int = 256 << 20   # per connection: ALLOC reservations not yet committed
    max_open_leases: int = 64             # per connection: LOCATE leases and ALLOC reservations open at once
    # Authenticated connections per namespace credential (the pool secret and the agent credential are
    # not capped: they are the pool's own). A deployment's engines share one credential and each keeps one
    # connection per agent, so this is about the engine processes of one deployment; it stays well below
    # max_connections so that one tenant's idle connections cannot lock the others out (issue 22).
    max_connections_per_credential: int = 128

    def deadline(self, nbytes: int) -> float:
        return time.monotonic() + self.io_seconds + nbytes / _WIRE_BYTES_PER_SECOND

    def caps(self) -> Caps:
        """The connection caps, enforced by ``pool.admission`` (the transfer engine's server uses the same)."""
        return Caps(self.max_connections, self.max_connections_per_address, self.max_preauth,
                    self.max_preauth_per_address, self.max_connections_per_credential)


@dataclass
class Session:
    """One authenticated connection: its scope and the leases and reservations only it may end."""

    peer: str
    scope: Scope
    leases: set[int] = field(default_factory=set)
    parked: dict[int, int] = field(default_factory=dict)  # reservation id -> bytes reserved

    @property
    def peer_role(self) -> bool:
        return self.scope.role in (credentials.ADMIN, credentials.AGENT)


class Service:
    """Answers requests on accepted connections against one ``BlockStore`` and the pool machinery."""

    def __init__(self, *, store: BlockStore, secret: bytes, welcome: Welcome, membership: Membership,
                 handoff: HandOff, records: Records, pull: PullThrough, limits: Limits | None = None,
                 tls: ssl.SSLContext | None = None) -> None:
        self.store = store
        self.secret = secret
        self.welcome = welcome
        self.membership = membership
        self.handoff = handoff
        self.records = records
        self.pull = pull
        self.limits = limits or Limits()
        self.tls = tls
        self.closed = threading.Event()
        self.admission = Admission(self.limits.caps(), label=f"server=store agent={self.agent_id}",
                                   on_refused=lambda: store.metrics.rejected.labels(reason="connection_cap").inc())
        self._local = threading.local()
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
            p.Op.FLUSH_NAMESPACE: self._flush_namespace,
        }

    @property
    def stream_transport(self) -> str:
        """The label of bytes moved over this service's own stream: ``tls`` when it wraps its connections."""
        return "tcp" if self.tls is None else "tls"

    def one_sided_transport(self, tier: str) -> str:
        """The transport a transfer-engine move into or out of ``tier`` took, as far as this agent can tell.

        The move is one-sided (the agent does not see it), so the label is inferred from the
        connection that asked for it: a peer on this host maps the segment (shm; link for HBM),
        any other reached it over rdma (the client picks the engine for host buffers only
        where the first route is one-sided; device buffers across nodes are GDR).
        """
        session: Session | None = getattr(self._local, "session", None)
        local = session is None or _on_this_host(session.peer.rpartition(":")[0].strip("[]"))
        if local:
            return "link" if tier == "hbm" else "shm"
        return "rdma"

    @property
    def agent_id(self) -> str:
        return self.membership.agent_id

    @property
    def session(self) -> Session:
        """The connection this thread serves."""
        session: Session = self._local.session
        return session

    def key_for(self, claim: str) -> bytes | None:
        scope = Scope.parse_claim(claim)
        return None if scope is None else credentials.key_for(self.secret, scope)

    # -- connections ------------------------------------------------------------------------------

    def accept_loop(self, sock: socket.socket) -> None:
        while not self.closed.is_set():
            try:
                conn, peer = sock.accept()
            except OSError as exc:
                if self.closed.is_set():
                    return
                self.admission.accept_failed(exc)
                continue
            host = str(peer[0])
            if not self.admission.admit(conn, host):
                continue
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            t = threading.Thread(target=self.serve, args=(conn, f"{host}:{peer[1]}"), daemon=True,
                                 name="store-conn")
            t.start()

    def shutdown_connections(self) -> None:
        self.admission.shutdown_all()

    def connection_counts(self) -> tuple[int, int]:
        """(all connections, connections inside the handshake)."""
        return self.admission.counts()

    def serve(self, conn: socket.socket, peer: str) -> None:
        host = peer.rpartition(":")[0]
        session: Session | None = None
        raw = conn
        deadline = time.monotonic() + self.limits.handshake_seconds
        try:
            if self.tls is not None:  # the TLS handshake counts against the same deadline
                conn = self.tls.wrap_socket(raw, server_side=True, do_handshake_on_connect=False)
                self.admission.replace(raw, conn)
                until(conn, deadline)
                conn.do_handshake()
            channel = _HelloChannel(conn, self._error, deadline=deadline)
            try:
                hello = server_accept(channel, key_for=self.key_for)
            except AuthenticationFailed:
                self.store.metrics.rejected.labels(reason="auth").inc()
                log.warning("event=connection_refused agent=%s peer=%s reason=wrong_credential", self.agent_id, peer)
                return
            scope = Scope.parse_claim(hello.scope)
            assert scope is not None  # server_accept refuses unknown scopes
            self.admission.authenticated(conn)
            if scope.role == credentials.NAMESPACE and not self.admission.admit_credential(conn, scope.claim):
                self.store.metrics.quota_refusals.labels(quota="connections").inc()
                self.store.metrics.rejected.labels(reason="credential_cap").inc()
                self._error(conn, channel.request_id, (
                    f"quota exceeded: {self.limits.max_connections_per_credential} connections of credential "
                    f"{scope.claim} are open on this agent (its maxConnectionsPerCredential); close idle ones"))
                return
            session = Session(peer, scope)
            self._local.session = session
            w = self.welcome
            reply = p.HelloReply(self.agent_id, w.pool, w.shm_probe, w.shm_nonce, w.lease_seconds, w.replicas).encode()
            send_all(conn, p.frame(p.Op.REPLY, reply, request_id=channel.request_id),
                     deadline=self.limits.deadline(0))
            while not self.closed.is_set():
                try:
                    header, meta = self._read_request(conn)
                except (ConnectionError, TimeoutError):
                    return
                started = time.perf_counter()
                try:
                    self.dispatch(conn, header, meta)
                except QuotaExceeded as exc:
                    # Nothing was reserved or leased: answer, drop an unread PUT body, keep the connection.
                    self.admission.log_limited("event=request_refused agent=%s peer=%s scope=%s reason=quota_exceeded "
                                               "quota=%s", self.agent_id, peer, scope.claim, exc.quota)
                    if header.data_len:
                        discard(conn, header.data_len, deadline=self.limits.deadline(header.data_len))
                    self._error(conn, header.request_id, str(exc))
                    continue
                except NotAuthorized as exc:
                    self.store.metrics.rejected.labels(reason="scope").inc()
                    log.warning("event=request_refused agent=%s peer=%s scope=%s reason=%r", self.agent_id, peer,
                                scope.claim, str(exc))
                    self._error(conn, header.request_id, f"not authorized: {exc}")
                    return
                self.store.metrics.latency.labels(op=header.op.name.lower()).observe(time.perf_counter() - started)
        except ssl.SSLEOFError as exc:
            # The peer hung up mid-TLS: a tcpSocket probe does that every few seconds on a TLS pool.
            log.debug("event=connection_lost agent=%s peer=%s reason=%s", self.agent_id, peer, exc)
        except (p.ProtocolError, ssl.SSLError) as exc:
            self.store.metrics.rejected.labels(reason="protocol").inc()
            log.warning("event=connection_closed agent=%s peer=%s reason=%r", self.agent_id, peer, str(exc))
        except (ConnectionError, TimeoutError, OSError) as exc:
            log.debug("event=connection_lost agent=%s peer=%s reason=%s", self.agent_id, peer, exc)
        finally:
            if session is not None:
                self._end_session(session)
            self.admission.release(host, raw, conn)
            conn.close()

    def _read_request(self, conn: socket.socket) -> tuple[p.Header, bytearray]:
        """The next request: idle_seconds for it to start, io_seconds for its metadata."""
        header = p.unpack_header(recv_exact(conn, p.HEADER_SIZE, deadline=time.monotonic() + self.limits.idle_seconds))
        return header, recv_exact(conn, header.meta_len, deadline=self.limits.deadline(header.meta_len))

    def _end_session(self, session: Session) -> None:
        """A connection is gone: what it still held goes back now, not at lease expiry."""
        for lease_id in session.leases:
            self.store.end_lease(lease_id)
        for rid in session.parked:
            parked = self.store.unpark(rid) or []
            self.store.commit([r for r in parked if r is not None], ok=False)

    def dispatch(self, conn: socket.socket, header: p.Header, meta: bytearray) -> None:
        handler = self.handlers.get(header.op)
        if handler is None:  # REPLY, ERROR and HELLO are never requests
            raise p.ProtocolError(f"unexpected {header.op.name} frame from a client")
        request = p.decode_request(header.op, meta)
        if header.op != p.Op.PUT and header.data_len:
            raise p.ProtocolError(f"{header.op.name} carries no data section, got {header.data_len} bytes")
        self._authorize(header, request)
        self._admit_quotas(header, request)
        handler(conn, header, request)

    def _admit_quotas(self, header: p.Header, request: object) -> None:
        """Refuse (``QuotaExceeded``) a lease, reservation or pin past its namespace's quota, before any is made.

        Here, ahead of every handler that leases (LOCATE, XLOCATE), parks reservations (ALLOC, XALLOC)
        or pins (any write with ``pin_seconds``), so the engine ops in ``datapath`` are covered too.
        A PUT's own reservations are not held: they last one request, under its io deadline.
        """
        # By field, not request class: the engine ops' requests may grow (datapath.py) and still carry these.
        op = header.op
        keys: list[str] = list(getattr(request, "keys", None) or [])
        if op in (p.Op.LOCATE, p.Op.XLOCATE):
            self.store.admit(lease=keys)
        elif op in (p.Op.ALLOC, p.Op.XALLOC, p.Op.PUT):
            items = list(zip(keys, getattr(request, "sizes", None) or [], strict=True))
            pin_seconds = int(getattr(request, "pin_seconds", 0) or 0)
            self.store.admit(reserve=items if op != p.Op.PUT else (), pin=items if pin_seconds else (),
                             tier="hbm" if getattr(request, "tier", 0) == 1 else "dram", pin_seconds=pin_seconds)

    def _authorize(self, header: p.Header, request: object) -> None:
        """The connection's scope decides: pool-peer ops and flags need a peer credential, keys their namespace."""
        session: Session | None = getattr(self._local, "session", None)
        if session is None:  # in-process callers (tests) that skipped the handshake
            return
        if not session.peer_role and (header.op in PEER_OPS or header.flags & p.FLAG_REPLICA):
            raise NotAuthorized(f"{header.op.name} (or FLAG_REPLICA) is for the pool's agents; "
                                f"this connection holds {session.scope.claim}")
        if header.op == p.Op.FLUSH_NAMESPACE:
            # Admin flushes any namespace, a namespace credential only its own; an agent credential none
            # (agents never flush each other: each flushes its own store in-process, docs/operations.md).
            assert isinstance(request, p.NamespaceRequest)
            role = session.scope.role
            if role == credentials.ADMIN or (role == credentials.NAMESPACE
                                             and request.namespace == session.scope.namespace):
                return
            raise NotAuthorized(f"FLUSH_NAMESPACE of {request.namespace!r} needs the pool secret or that "
                                f"namespace's credential; this connection holds {session.scope.claim}")
        keys = getattr(request, "keys", None)
        if keys and session.scope.role == credentials.NAMESPACE:
            outside = [k for k in keys if not session.scope.allows_key(k)]
            if outside:
                raise NotAuthorized(f"key {outside[0][:80]!r} is outside namespace {session.scope.namespace!r}, "
                                    f"the only one this credential may use")

    def _error(self, conn: socket.socket, rid: int, text: str) -> None:
        with contextlib.suppress(OSError):
            send_all(conn, p.frame(p.Op.ERROR, p.TextReply(text).encode(), request_id=rid),
                     deadline=self.limits.deadline(0))

    def _reply(self, conn: socket.socket, rid: int, meta: bytes, data: list[memoryview] | None = None) -> None:
        total = sum(len(d) for d in data or [])
        send_all(conn, [*p.frame(p.Op.REPLY, meta, request_id=rid, data_len=total), *(data or [])],
                 deadline=self.limits.deadline(total))

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
        replica = bool(header.flags & p.FLAG_REPLICA)
        deadline = self.limits.deadline(header.data_len)
        infos: list[p.BlockInfo] = []
        written: list[Reservation] = []
        # One block at a time, and only once its bytes start to arrive: a header promising data that never
        # comes reserves (and evicts for) nothing, and a stalled body holds its space only until the deadline.
        try:
            for key, size, checksum in zip(req.keys, req.sizes, req.checksums, strict=True):
                first = recv_exact(conn, 1, deadline=deadline) if size else bytearray()
                with self.handoff.admitting(replica=replica) as refused:
                    slot = p.Status.LEAVING if refused else self.store.reserve(
                        key, size, checksum, tier=tier, pin_seconds=req.pin_seconds)
                if not isinstance(slot, Reservation):
                    discard(conn, size - len(first), deadline=deadline)
                    infos.append(p.BlockInfo(slot))
                    continue
                written.append(slot)
                self.store.back([slot])  # fault in this block's extent now, not block by block in a cold tier
                target = self.store.write_buffer(slot)
                target[:len(first)] = first
                recv_exact_into(conn, target[len(first):], deadline=deadline)
                if crc32c(target) != slot.checksum:  # the writer's checksum is checked, not trusted
                    written.pop()
                    self.store.commit([slot], ok=False)
                    self.store.metrics.corrupt.inc()
                    infos.append(p.BlockInfo(p.Status.CORRUPT))
                    continue
                self.store.finish_write(slot, target)
                infos.append(p.BlockInfo(p.Status.OK, slot.size, slot.checksum))
        except BaseException:
            self.store.commit(written, ok=False)
            raise
        self.store.commit(written)
        self.store.metrics.moved(self.stream_transport, "write", header.data_len)
        if header.flags & p.FLAG_RECORD and written:
            self.records.send_later([r.key for r in written])
        self._blocks(conn, header, infos)

    def _open_leases(self) -> int:
        session = self.session
        return len(session.leases) + len(session.parked)

    # -- per-connection holds, also for the transfer-engine ops in agent/store/datapath.py ---------------

    def admit_hold(self) -> int | None:
        """Refuse a new lease or reservation past the connection's cap; the bytes it may still reserve.

        ``None`` for in-process callers that skipped the handshake (no connection to bound).
        """
        session: Session | None = getattr(self._local, "session", None)
        if session is None:
            return None
        if self._open_leases() >= self.limits.max_open_leases:
            raise NotAuthorized(f"{self.limits.max_open_leases} leases and reservations already open on this "
                                "connection; COMMIT or RELEASE some first")
        return self.limits.max_reserved_bytes - sum(session.parked.values())

    def hold_lease(self, lease_id: int) -> None:
        """The lease ends with RELEASE on this connection, or when the connection closes."""
        session: Session | None = getattr(self._local, "session", None)
        if session is not None and lease_id:
            session.leases.add(lease_id)

    def hold_reservation(self, reservation_id: int, size: int) -> None:
        """The reservation is committed or aborted by this connection only, or aborted when it closes."""
        session: Session | None = getattr(self._local, "session", None)
        if session is not None:
            session.parked[reservation_id] = size

    def owns_reservation(self, reservation_id: int) -> bool:
        """Take the reservation out of this connection's holds; False when another connection made it."""
        session: Session | None = getattr(self._local, "session", None)
        return session is None or session.parked.pop(reservation_id, None) is not None

    def _require_shm(self) -> None:
        """ALLOC and LOCATE hand out /dev/shm extents for a same-node memcpy: only where shm is allowed."""
        if not self.welcome.shm_probe:
            raise NotAuthorized("shm is not among this pool's transports (spec.transport.preference): the DRAM "
                                "tier is not mapped by clients; use PUT/GET over the stream")

    def _alloc(self, conn: socket.socket, header: p.Header, request: object) -> None:
        assert isinstance(request, p.AllocRequest)
        self._require_shm()
        req = request
        session = self.session
        if self._open_leases() >= self.limits.max_open_leases:
            raise NotAuthorized(f"{self.limits.max_open_leases} leases and reservations already open on this "
                                "connection; COMMIT or RELEASE some first")
        budget = self.limits.max_reserved_bytes - sum(session.parked.values())
        slots: list[Reservation | p.Status] = []
        with self.handoff.admitting() as refused:
            for k, size, c in zip(req.keys, req.sizes, req.checksums, strict=True):
                if refused:
                    slots.append(p.Status.LEAVING)
                elif size > budget:
                    slots.append(p.Status.FULL)  # this connection's reservation budget, not the tier
                else:
                    slot = self.store.reserve(k, size, c, pin_seconds=req.pin_seconds)
                    if isinstance(slot, Reservation):
                        budget -= size
                    slots.append(slot)
        if refused:
            self._blocks(conn, header, [p.BlockInfo(p.Status.LEAVING) for _ in req.keys])
            return
        self.store.back(slots)
        self.store.clear(slots)  # the client's memcpy may write less than reserved: no residue behind it
        parked: list[Reservation | None] = [s if isinstance(s, Reservation) else None for s in slots]
        rid_parked = self.store.park(parked)
        session.parked[rid_parked] = sum(r.size for r in parked if r is not None)
        infos = [p.BlockInfo(p.Status.OK, s.size, s.checksum, *self.store.location(s))
                 if isinstance(s, Reservation) else p.BlockInfo(s) for s in slots]
        self._blocks(conn, header, infos, lease_id=rid_parked)

    def _commit(self, conn: socket.socket, header: p.Header, request: object) -> None:
        assert isinstance(request, p.LeaseRequest)
        session = getattr(self._local, "session", None)
        # Only the connection that reserved may commit or abort (ids of others are unknown here).
        owned = session is None or session.parked.pop(request.lease_id, None) is not None
        parked = (self.store.unpark(request.lease_id) or []) if owned else []
        done = [r for r in parked if r is not None]
        abort = bool(header.flags & p.FLAG_ABORT)
        good: list[Reservation] = []
        for r in done:
            # The client copied these bytes into the segment itself: check them before publishing.
            view = self.store.write_buffer(r)
            (good if abort or crc32c(view) == r.checksum else []).append(r)
        self.store.commit(good, ok=not abort)
        if not abort:  # the client's memcpy into the mapped segment (ALLOC) moved these
            self.store.metrics.moved("shm", "write", sum(r.size for r in good))
        self.store.commit([r for r in done if r not in good], ok=False)
        if header.flags & p.FLAG_RECORD and not abort and good:
            self.records.send_later([r.key for r in good])
        self._blocks(conn, header, [p.BlockInfo(p.Status.MISS if r is None else
                                                p.Status.OK if r in good else p.Status.CORRUPT) for r in parked])

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
            self.store.metrics.moved(self.stream_transport, "read", sum(len(d) for d in data))
        finally:
            self.store.release(blocks)

    def _locate(self, conn: socket.socket, header: p.Header, request: object) -> None:
        assert isinstance(request, p.KeysRequest)
        self._require_shm()
        req = request
        session = getattr(self._local, "session", None)
        if session is not None and self._open_leases() >= self.limits.max_open_leases:
            raise NotAuthorized(f"{self.limits.max_open_leases} leases and reservations already open on this "
                                "connection; RELEASE some first")
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
        # The client copies these out of the mapped segment under the lease: counted as they are handed out.
        self.store.metrics.moved("shm", "read", sum(i.size for i in infos if i.status == p.Status.OK and i.where))
        lease_id = self.store.lease(blocks)
        if session is not None:
            session.leases.add(lease_id)
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
        session = getattr(self._local, "session", None)
        if session is None or request.lease_id in session.leases:  # another connection's lease is not ours to end
            if session is not None:
                session.leases.discard(request.lease_id)
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

    def flush_namespace(self, namespace: str) -> p.FlushReply:
        """Delete every block of ``namespace`` held here and every record of one held elsewhere.

        The one implementation: the FLUSH_NAMESPACE handler and the agent's in-process flush
        (the KVPool's ``status.flushRequests``) both call it."""
        if not credentials.NAMESPACE_PATTERN.fullmatch(namespace):
            raise ValueError(f"namespace {namespace!r} must match {credentials.NAMESPACE_PATTERN.pattern}")
        prefix = namespace + "/"
        blocks, freed, busy = self.store.remove_prefix(prefix)
        pointers = self.records.forget_prefix(prefix)
        log.info("event=namespace_flushed agent=%s namespace=%s blocks=%d bytes=%d busy=%d records=%d",
                 self.agent_id, namespace, blocks, freed, busy, pointers)
        return p.FlushReply(blocks, freed, busy, pointers)

    def _flush_namespace(self, conn: socket.socket, header: p.Header, request: object) -> None:
        assert isinstance(request, p.NamespaceRequest)
        self._reply(conn, header.request_id, self.flush_namespace(request.namespace).encode())

    def _stats(self, conn: socket.socket, header: p.Header, request: object) -> None:
        counts = {**self.store.stats(), "rss_bytes": _rss_bytes(), "rss_peak_bytes": _peak_rss_bytes(),
                  "peers_live": len(self.membership.live_ids()) - 1, "pointers": len(self.records),
                  "connections": self.connection_counts()[0], "connections_handshaking": self.connection_counts()[1]}
        text = "\n".join(f"{k}={v}" for k, v in counts.items())
        self._reply(conn, header.request_id, p.TextReply(text).encode())


class _HelloChannel:
    """The store protocol's side of ``pool.handshake.ServerChannel``: two HELLO frames under one deadline.

    Before authentication a frame may be a HELLO of at most ``MAX_PREAUTH_META_BYTES`` metadata and no
    data, checked from the 24-byte header before anything is allocated.
    """

    def __init__(self, conn: socket.socket, error: Callable[[socket.socket, int, str], None], *,
                 deadline: float) -> None:
        self._conn = conn
        self._error = error
        self._deadline = deadline
        self.request_id = 0

    def _frame(self) -> bytearray:
        header = p.unpack_header(recv_exact(self._conn, p.HEADER_SIZE, deadline=self._deadline))
        if header.op != p.Op.HELLO:
            raise p.ProtocolError(f"frame {header.op.name} before the handshake finished, expected HELLO")
        if header.meta_len > p.MAX_PREAUTH_META_BYTES or header.data_len:
            raise p.ProtocolError(f"HELLO of {header.meta_len}+{header.data_len} bytes exceeds the "
                                  f"{p.MAX_PREAUTH_META_BYTES}-byte handshake limit")
        self.request_id = header.request_id
        return recv_exact(self._conn, header.meta_len, deadline=self._deadline)

    def recv_hello(self) -> Hello:
        hello = p.Hello.decode(self._frame())
        return Hello(hello.client, hello.scope, hello.nonce)

    def send_challenge(self, challenge: Challenge) -> None:
        meta = p.HelloChallenge(challenge.nonce, challenge.proof).encode()
        send_all(self._conn, p.frame(p.Op.REPLY, meta, request_id=self.request_id), deadline=self._deadline)

    def recv_proof(self) -> bytes:
        return p.HelloProof.decode(self._frame()).proof

    def send_refusal(self, reason: str) -> None:
        self._error(self._conn, self.request_id, f"authentication failed: {reason}")


@functools.cache
def _host_addresses() -> frozenset[str]:
    try:
        return frozenset(str(a[4][0]) for a in socket.getaddrinfo(socket.gethostname(), None))
    except OSError:
        return frozenset()


def _on_this_host(host: str) -> bool:
    try:
        if ipaddress.ip_address(host).is_loopback:
            return True
    except ValueError:
        return False
    return host in _host_addresses()


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
