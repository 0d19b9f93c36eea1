"""The tcp transport: a server per engine, several connections per peer, sliced frames, zero-copy both ways.

Client side: a batch's requests to one peer are cut into slices of at most
``slice_bytes`` and small requests are packed together, so one frame carries
one slice of a big request or many small requests (one ``sendmsg`` with an
iovec per extent: no bytes are copied in Python). Frames go into the peer's
queue; every connection has a sender thread taking from it (the striping) and
a receiver thread that reads ACK/DATA/ERROR answers, landing READ data with
``recv_into`` straight into the destination buffer. Server side: one thread per
connection reads a header and lands WRITE payloads with ``recv_into`` straight
into the registered segment. Both sides speak ``daybreak.agent.transfer.wire``.

Failures: a connection that breaks sends its in-flight frames to the peer's
other connections (a fresh one when none is left) up to ``MAX_ATTEMPTS`` times
while the deadline allows; a peer that cannot be reached fails the jobs as a
path failure. A batch that passes its deadline has the connections carrying
its frames shut down, so a READ never lands after ``wait`` returned.

TLS (``tls``, the agent's ``tls_*`` settings through ``pool.tls``): every
connection, data and control, is TLS before its HELLO, and the server refuses a
plaintext peer (``control.accept``). The sender and receiver threads share one
connection, which is why it is a ``pool.tls.TlsStream`` and not an ``SSLSocket``.
"""

from __future__ import annotations

import errno
import json
import logging
import queue
import select
import socket
import ssl
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import crc32c

from daybreak.agent.transfer import metrics, wire
from daybreak.agent.transfer.batch import BatchHandle, Op
from daybreak.agent.transfer.control import (
    HANDSHAKE_SECONDS,
    PlaintextRefused,
    accept,
    client_handshake,
    dial,
    parse_endpoint,
    server_handshake,
)
from daybreak.agent.transfer.transport import Job, LocalSegment, Transport, TransportHost
from daybreak.errors import DaybreakError
from daybreak.pool.admission import Admission, Caps
from daybreak.pool.credentials import ADMIN
from daybreak.pool.sockets import Stream, recv_exact_into, send_all
from daybreak.pool.tls import TlsContexts

log = logging.getLogger(__name__)

__all__ = ["TcpOptions", "TcpTransport"]

MAX_ATTEMPTS = 3
INLINE_SEND_BYTES = 1 << 20  # per submit, sent from the caller's thread when a connection is idle
# How long the receiver thread leaves an inline frame's answer to its waiter before reading it
# itself (the caller may be awaiting in asyncio or polling instead of blocking in wait()).
PUMP_GRACE_S = 0.002
CONNECT_TIMEOUT_S = 5.0
# A connection unused this long is checked for a close by the peer (its server's idle timeout) before reuse.
IDLE_PROBE_S = 0.5
_DRAIN = 1 << 20


@dataclass(slots=True)
class _Piece:
    job: Job
    view: memoryview  # the local bytes of this piece
    segment: int  # remote tcp handle
    offset: int  # remote offset
    crc: int = 0
    capability: bytes = b""  # the job's grant: covers every piece of it


@dataclass(slots=True)
class _Frame:
    op: Op
    batch: BatchHandle
    pieces: list[_Piece]
    nbytes: int
    attempts: int = 0
    errors: list[str] = field(default_factory=list)
    sync: bool = False  # sent from the caller's thread: its waiter reads the answer (see _Conn.pump)
    sent_at: float = 0.0

    def live(self) -> bool:
        return any(p.job.pending() for p in self.pieces)


@dataclass(frozen=True, slots=True)
class TcpOptions:
    """The engine's tcp settings: where to listen, connections per peer, slice size, checksums, TLS."""

    listen: str
    advertise: str | None
    connections: int
    slice_bytes: int
    checksum: bool
    tls: TlsContexts | None = None
    caps: Caps = field(default_factory=Caps)  # the server's connection caps (total, per peer address, handshaking)
    idle_seconds: float = 300.0  # an authenticated server connection with no frame for this long is closed


class TcpTransport(Transport):
    name = "tcp"

    def __init__(self, host: TransportHost, *, listen: str = "127.0.0.1:0", advertise: str | None = None,
                 connections: int = 2, slice_bytes: int = 4 << 20, checksum: bool = False,
                 tls: TlsContexts | None = None, caps: Caps | None = None, idle_seconds: float = 300.0) -> None:
        if idle_seconds <= 0:
            raise ValueError(f"idle_seconds: must be positive, got {idle_seconds}")
        self._host = host
        self.options = TcpOptions(listen, advertise, connections, slice_bytes, checksum, tls, caps or Caps(),
                                  idle_seconds)
        self._peers: dict[str, _Peer] = {}
        self._lock = threading.Lock()
        self._server = _Server(host, self.options)
        self.endpoint = self._server.endpoint

    def supports(self, job: Job) -> bool:
        return job.view is not None and bool(job.remote.descriptor.tcp_endpoint)

    def start(self, jobs: list[Job]) -> None:
        by_peer: dict[str, list[Job]] = {}
        for job in jobs:
            by_peer.setdefault(job.remote.descriptor.tcp_endpoint, []).append(job)
        for endpoint, group in by_peer.items():
            with self._lock:
                peer = self._peers.get(endpoint)
                if peer is None or peer.closed:
                    peer = self._peers[endpoint] = _Peer(self._host, self.options, endpoint)
            peer.submit(group)

    def abort(self, batch: BatchHandle) -> None:
        for peer in list(self._peers.values()):
            peer.abort(batch)

    def close(self) -> None:
        self._server.close()
        for peer in list(self._peers.values()):
            peer.close()


# ---------------------------------------------------------------------------- client side
def _slice(jobs: Sequence[Job], *, slice_bytes: int, checksum: bool) -> list[_Frame]:
    """Cut jobs into frames of at most ``slice_bytes`` payload; small jobs share frames."""
    frames: list[_Frame] = []
    for op in (Op.WRITE, Op.READ):
        pieces: list[_Piece] = []
        size = 0
        for job in jobs:
            if job.op is not op:
                continue
            handle = job.remote.descriptor.tcp_handle
            assert job.view is not None
            job.state = 0  # pieces still outstanding
            for start in range(0, job.length, slice_bytes):
                view = job.view[start:start + slice_bytes]
                piece = _Piece(job, view, handle, job.remote_offset + start, capability=job.capability)
                if checksum and op is Op.WRITE:
                    piece.crc = crc32c.crc32c(view)
                job.state += 1
                if pieces and (size + view.nbytes > slice_bytes or len(pieces) >= wire.MAX_EXTENTS):
                    frames.append(_Frame(op, job.batch, pieces, size))
                    pieces, size = [], 0
                pieces.append(piece)
                size += view.nbytes
        if pieces:
            frames.append(_Frame(op, pieces[0].job.batch, pieces, size))
    return frames


class _Peer:
    """All connections to one remote engine, sharing one queue of frames."""

    def __init__(self, host: TransportHost, options: TcpOptions, endpoint: str) -> None:
        self.host = host
        self.options = options
        self.endpoint = endpoint
        self.address = parse_endpoint(endpoint, field_name="tcp_endpoint")
        self.queue: queue.SimpleQueue[_Frame | None] = queue.SimpleQueue()
        self.conns: list[_Conn] = []
        self.lock = threading.Lock()  # guards conns; held while connecting
        self.count_lock = threading.Lock()  # guards the jobs' outstanding-piece counts
        self.closed = False
        self.peer_engine = ""

    def submit(self, jobs: list[Job]) -> None:
        try:
            self._ensure_connections(jobs[0].batch.deadline)
        except OSError as exc:
            for job in jobs:
                self.host.job_path_failed(job, f"cannot connect to {self.endpoint}: {exc}", transport="tcp")
            return
        budget = INLINE_SEND_BYTES
        for frame in _slice(jobs, slice_bytes=self.options.slice_bytes, checksum=self.options.checksum):
            # Small frames go out from the submitting thread when a connection is idle: handing
            # them to a sender thread costs a thread switch, which is most of a 64 KiB write.
            cost = frame.nbytes if frame.op is Op.WRITE else 0
            if cost <= budget and self._send_inline(frame):
                budget -= cost
            else:
                self.queue.put(frame)

    def _send_inline(self, frame: _Frame) -> bool:
        for conn in self.conns:
            if conn.alive and conn.send_lock.acquire(blocking=False):
                # only while submit has not returned can the caller's wait() be the reader
                sync = not frame.batch.handed_out
                try:
                    frame.sync = sync
                    if not conn.send(frame):
                        # The connection was dead: send() has already handed the frame on (requeued
                        # or failed over). Reporting it unsent would queue it a second time, and its
                        # pieces would be counted done twice.
                        return True
                finally:
                    conn.send_lock.release()
                if sync:
                    frame.batch.add_pump(conn)
                return True
        return False

    def _ensure_connections(self, deadline: float) -> None:
        conns = self.conns
        for conn in conns:
            conn.closed_while_idle()
        if len(conns) >= self.options.connections and all(c.alive for c in conns):
            return  # the common case, without the lock
        with self.lock:
            alive = [c for c in self.conns if c.alive]
            self.conns = alive
            missing = self.options.connections - len(alive)
            for _ in range(missing):
                timeout = max(0.05, min(CONNECT_TIMEOUT_S, deadline - time.monotonic()))
                try:
                    conn = _Conn(self, timeout)
                except OSError:
                    if self.conns:
                        break  # fewer connections than asked, but the peer is reachable
                    raise
                self.conns.append(conn)

    def requeue(self, frame: _Frame, cause: str) -> None:
        """A connection broke under ``frame``: try again elsewhere, or fail its jobs over."""
        frame.errors.append(cause)
        frame.attempts += 1
        if not frame.live():
            return
        if frame.attempts < MAX_ATTEMPTS and time.monotonic() < frame.batch.deadline and not self.closed:
            try:
                self._ensure_connections(frame.batch.deadline)
            except OSError as exc:
                frame.errors.append(f"reconnect to {self.endpoint}: {exc}")
            else:
                metrics.RETRIES.labels("tcp").inc()
                frame.sync = False  # a sender thread takes it now: its waiter pumps the old connection, not the new
                self.queue.put(frame)
                return
        self.fail_frame(frame, "; ".join(frame.errors[-2:]), path=True)

    def connection_lost(self, cause: str) -> None:
        """With no live connection left and none to be made, nobody would drain the queue: fail it now."""
        if any(c.alive for c in self.conns) or self.queue.empty():
            return  # someone drains the queue, or there is nothing to drain: the next submit reconnects
        try:
            if not self.closed:
                self._ensure_connections(time.monotonic() + CONNECT_TIMEOUT_S)
                return
            reason = "engine closing"
        except OSError as exc:
            reason = f"{cause}; reconnect to {self.endpoint}: {exc}"
        while True:
            try:
                frame = self.queue.get_nowait()
            except queue.Empty:
                return
            if frame is not None and frame.live():
                self.fail_frame(frame, reason, path=True)

    def fail_frame(self, frame: _Frame, cause: str, *, path: bool) -> None:
        seen: set[int] = set()
        for piece in frame.pieces:
            job = piece.job
            if id(job) in seen or not job.pending():
                continue
            seen.add(id(job))
            if path:
                self.host.job_path_failed(job, cause, transport="tcp")
            else:
                self.host.job_request_failed(job, cause, transport="tcp")

    def pieces_done(self, frame: _Frame) -> None:
        finished: list[Job] = []
        with self.count_lock:
            for piece in frame.pieces:
                piece.job.state -= 1
                if piece.job.state == 0:
                    finished.append(piece.job)
        if finished:
            self.host.jobs_done(finished, "tcp")

    def abort(self, batch: BatchHandle) -> None:
        for conn in list(self.conns):
            if conn.carries(batch):
                conn.shutdown(f"batch deadline passed on {self.endpoint}")

    def close(self) -> None:
        self.closed = True
        with self.lock:
            conns, self.conns = self.conns, []
        for conn in conns:
            conn.shutdown("engine closing")
            self.queue.put(None)


class _Conn:
    """One tcp connection to a peer: a sender thread and a receiver thread."""

    _ids = iter(range(1, 1 << 62))

    def __init__(self, peer: _Peer, timeout: float) -> None:
        self.peer = peer
        try:
            self.sock: Stream = dial(peer.address, timeout_s=timeout, tls=peer.options.tls)
        except ssl.SSLError as exc:
            raise OSError(f"TLS with {peer.endpoint} failed: {exc}") from None
        try:
            self._hello()
        except (OSError, ValueError, wire.MalformedFrame) as exc:
            self.sock.close()
            raise OSError(f"handshake with {peer.endpoint} failed: {exc}") from None
        self.sock.settimeout(None)  # deadlines are enforced by shutting the socket down
        self.alive = True
        self.last_used = time.monotonic()
        self.inflight: dict[int, _Frame] = {}
        self.lock = threading.Lock()
        self.send_lock = threading.Lock()  # one frame at a time on the wire
        self.recv_lock = threading.Lock()  # one reader at a time: the receiver thread or a pumping waiter
        self.ready = threading.Condition(self.lock)
        self.header = bytearray(wire.HEADER.size)
        name = f"tcp-{peer.endpoint}"
        self.sender = threading.Thread(target=self._send_loop, name=f"{name}-send", daemon=True)
        self.receiver = threading.Thread(target=self._recv_loop, name=f"{name}-recv", daemon=True)
        self.sender.start()
        self.receiver.start()

    def _hello(self) -> None:
        self.peer.peer_engine = client_handshake(self.sock, engine_id=self.peer.host.engine_id,
                                                 token=self.peer.host.token)

    def carries(self, batch: BatchHandle) -> bool:
        with self.lock:
            return any(f.batch is batch for f in self.inflight.values())

    def shutdown(self, cause: str) -> None:
        if self.alive:
            log.info("tcp connection shut down peer=%s cause=%r", self.peer.endpoint, cause)
        self.alive = False
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def closed_while_idle(self) -> bool:
        """True (and broken) when the peer closed this idle connection, e.g. at its server's idle timeout.

        The receiver thread sleeps while nothing is in flight, so nobody would notice before the next frame
        was sent into the closed socket and had to be retried. Checked only after ``IDLE_PROBE_S`` unused.
        """
        if not self.alive or self.inflight or time.monotonic() - self.last_used < IDLE_PROBE_S:
            return False
        try:
            readable = bool(select.select([self.sock.fileno()], [], [], 0)[0])
        except (OSError, ValueError):
            readable = True
        if readable and not self.inflight:  # nothing asked: readable means EOF, a reset or a stray byte
            self._broken(f"{self.peer.endpoint} closed the idle connection")
            return True
        return False

    def _send_loop(self) -> None:
        while self.alive:
            try:
                # the timeout lets a broken connection's sender notice and exit
                frame = self.peer.queue.get(timeout=1.0)
            except queue.Empty:
                continue
            if frame is None:
                return
            with self.send_lock:
                if not self.send(frame):
                    return

    def send(self, frame: _Frame) -> bool:
        """Send one frame (caller holds ``send_lock``); False when this connection is dead."""
        if not frame.live():
            return True  # its batch finished (deadline) while it queued
        checksum = self.peer.options.checksum
        frame_id = next(_Conn._ids)
        kind = wire.FrameType.WRITE if frame.op is Op.WRITE else wire.FrameType.READ
        extents = [wire.Extent(p.segment, p.offset, p.view.nbytes, p.crc) for p in frame.pieces]
        # A frame with any capability carries the table (one entry per extent, empty for none).
        caps = wire.pack_capabilities([p.capability for p in frame.pieces]) \
            if any(p.capability for p in frame.pieces) else b""
        head = wire.pack_header(kind, frame_id=frame_id, count=len(extents),
                                payload_len=frame.nbytes if frame.op is Op.WRITE else 0,
                                flags=(wire.FLAG_CRC if checksum else 0) | (wire.FLAG_CAPS if caps else 0),
                                caps_len=len(caps))
        buffers: list[Any] = [head + wire.pack_extents(extents) + caps]
        if frame.op is Op.WRITE:
            buffers.extend(p.view for p in frame.pieces)
        with self.lock:
            if not self.alive:
                frame.sync = False  # for a sender thread's connection, whose receiver must read the answer
                self.peer.queue.put(frame)  # a live connection takes it
                return False
            frame.sent_at = self.last_used = time.monotonic()
            self.inflight[frame_id] = frame
            if not frame.sync:
                self.ready.notify()  # sync frames are read by their waiter (or after a kick)
        try:
            send_all(self.sock, buffers)
        except OSError as exc:
            self._broken(f"send to {self.peer.endpoint} failed: {exc}")
            return False
        return True

    def _recv_loop(self) -> None:
        """Read answers nobody else reads: frames sent by sender threads, and inline frames whose
        waiter has not come for them within ``PUMP_GRACE_S`` (it may ``await`` or poll instead)."""
        while self.alive:
            with self.lock:
                while self.alive:
                    wait: float | None = None  # nothing in flight: sleep until notified
                    if self.inflight:
                        oldest = next(iter(self.inflight.values()))
                        wait = 0.0 if not oldest.sync else oldest.sent_at + PUMP_GRACE_S - time.monotonic()
                        if wait <= 0:
                            break
                    self.ready.wait(wait)
            with self.recv_lock:
                if self.alive and self.inflight:
                    self._read_one()

    def kick(self) -> None:
        with self.lock:
            self.ready.notify()

    def pump(self, batch: BatchHandle) -> None:
        """Read answers in the waiting caller's thread until ``batch`` has nothing left on this connection.

        For small synchronous batches this saves the hand-off from a receiver thread to the
        waiter, which is most of the latency of a 64 KiB round trip.
        """
        while not batch.settled() and self.alive:
            with self.lock:
                if not any(f.batch is batch for f in self.inflight.values()):
                    return
            with self.recv_lock:
                if self.alive and self.inflight and not batch.settled():
                    self._read_one()

    def _read_one(self) -> None:
        """Read and dispatch one answer (caller holds ``recv_lock``); a broken stream breaks the connection."""
        try:
            header = memoryview(self.header)
            recv_exact_into(self.sock, header)
            hdr = wire.parse_header(header)
            with self.lock:
                frame = self.inflight.pop(hdr.frame_id, None)
            if frame is None:
                raise wire.MalformedFrame(f"answer for unknown frame {hdr.frame_id}")
            if hdr.type is wire.FrameType.ACK:
                self.peer.pieces_done(frame)
            elif hdr.type is wire.FrameType.DATA:
                self._land(hdr, frame)
            elif hdr.type is wire.FrameType.ERROR:
                message = bytearray(hdr.payload_len)
                recv_exact_into(self.sock, memoryview(message))
                self.peer.fail_frame(frame, f"peer {self.peer.endpoint}: {message.decode(errors='replace')}",
                                     path=False)
            else:
                raise wire.MalformedFrame(f"unexpected {hdr.type.name} frame from the server")
        except wire.MalformedFrame as exc:
            log.warning("tcp malformed answer, closing connection peer=%s cause=%r", self.peer.endpoint, str(exc))
            self._broken(f"malformed answer from {self.peer.endpoint}: {exc}")
        except OSError as exc:
            self._broken(f"connection to {self.peer.endpoint} lost: {exc}")

    def _land(self, hdr: wire.Header, frame: _Frame) -> None:
        table = bytearray(hdr.count * wire.EXTENT.size)
        recv_exact_into(self.sock, memoryview(table))
        extents = wire.parse_extents(table, hdr.count, payload_len=hdr.payload_len)
        if len(extents) != len(frame.pieces) or any(e.length != p.view.nbytes
                                                    for e, p in zip(extents, frame.pieces, strict=True)):
            raise wire.MalformedFrame("DATA extents do not match the READ they answer")
        bad = ""
        for extent, piece in zip(extents, frame.pieces, strict=True):
            recv_exact_into(self.sock, piece.view)
            if hdr.flags & wire.FLAG_CRC and crc32c.crc32c(piece.view) != extent.crc:
                bad = f"crc32c mismatch in slice at remote offset {piece.offset}"
        if bad:
            self.peer.requeue(frame, bad)
        else:
            self.peer.pieces_done(frame)

    def _broken(self, cause: str) -> None:
        """Called once by whichever thread notices first; hands the in-flight frames on."""
        with self.lock:
            was_alive = self.alive
            self.alive = False
            frames, self.inflight = list(self.inflight.values()), {}
            self.ready.notify_all()
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
        if was_alive:
            log.warning("tcp connection broken peer=%s inflight=%d cause=%r", self.peer.endpoint, len(frames), cause)
        for frame in frames:
            self.peer.requeue(frame, cause)
        self.peer.connection_lost(cause)


# ---------------------------------------------------------------------------- server side
class _Server:
    """Accepts peers' connections and serves READ/WRITE frames against registered segments."""

    def __init__(self, host: TransportHost, options: TcpOptions) -> None:
        self.host = host
        address, port = parse_endpoint(options.listen, field_name="listen")
        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((address, port))
        self.sock.listen(128)
        bound_host, bound_port = self.sock.getsockname()[:2]
        if options.advertise:
            self.endpoint = options.advertise
        else:
            shown = bound_host if bound_host not in ("0.0.0.0", "::") else socket.gethostbyname(socket.gethostname())
            self.endpoint = f"[{shown}]:{bound_port}" if ":" in shown else f"{shown}:{bound_port}"
        self.tls = options.tls
        self.idle_seconds = options.idle_seconds
        self.admission = Admission(options.caps, label=f"server=transfer engine={host.engine_id}")
        self.closed = False
        threading.Thread(target=self._accept_loop, name=f"tcp-server-{bound_port}", daemon=True).start()

    def close(self) -> None:
        self.closed = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
        self.admission.shutdown_all()

    def _accept_loop(self) -> None:
        while not self.closed:
            try:
                conn, addr = self.sock.accept()
            except OSError as exc:
                if self.closed:
                    return
                # Out of descriptors (a flood, or a busy process): back off and keep serving. Returning
                # here would stop this engine's server for good; spinning would burn a core.
                if self.admission.accept_failed(exc):
                    continue
                if exc.errno in (errno.ECONNABORTED, errno.EPROTO, errno.EPERM):
                    continue  # that one connection went away before we took it
                return  # the listening socket itself is gone
            # Caps before a thread is spent on it (a thread per connection: the cap is the bound).
            if not self.admission.admit(conn, str(addr[0])):
                continue
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=self._serve, args=(conn, addr), name=f"tcp-serve-{addr[1]}", daemon=True).start()

    def _serve(self, conn: socket.socket, addr: Any) -> None:
        peer = f"{addr[0]}:{addr[1]}"
        # one deadline for the TLS handshake and the HELLO that follows it
        deadline = time.monotonic() + HANDSHAKE_SECONDS
        stream: Stream = conn
        try:
            stream = accept(conn, tls=self.tls, deadline=deadline, peer=peer)
            if stream is not conn:
                self.admission.replace(conn, stream)
            _ServerConn(self.host, stream, peer, deadline=deadline, idle_seconds=self.idle_seconds,
                        authenticated=self.admission.authenticated).run()
        except PlaintextRefused as exc:
            log.warning("tcp plaintext peer refused, TLS required peer=%s cause=%r", peer, str(exc))
        except ssl.SSLError as exc:
            log.warning("tcp TLS handshake or record failed, closing connection peer=%s cause=%r", peer, str(exc))
        except wire.MalformedFrame as exc:
            log.warning("tcp malformed frame, closing connection peer=%s cause=%r", peer, str(exc))
        except IdleTimeout as exc:
            log.info("tcp idle connection closed peer=%s cause=%r", peer, str(exc))
        except OSError as exc:
            log.debug("tcp server connection ended peer=%s cause=%r", peer, str(exc))
        except Exception:
            log.exception("tcp server connection crashed peer=%s", peer)
        finally:
            self.admission.release(str(addr[0]), conn, stream)
            conn.close()


class IdleTimeout(DaybreakError, TimeoutError):
    """An authenticated connection sent no frame within the server's ``idle_seconds``."""


class _ServerConn:
    def __init__(self, host: TransportHost, sock: Stream, peer: str, *, deadline: float | None = None,
                 idle_seconds: float | None = None, authenticated: Callable[[Any], None] | None = None) -> None:
        self.host = host
        self.sock = sock
        self.peer = peer
        self.deadline = deadline
        self.idle_seconds = idle_seconds
        self._authenticated = authenticated
        # a header and the first extent usually arrive together: read both in one call
        self.head = memoryview(bytearray(2 * wire.HEADER.size))
        self.spill = memoryview(b"")  # bytes read past a header, handed out before the socket's
        self.claim = ""  # the scope the peer proved in the handshake: what its capabilities must be granted to

    def _next_header(self) -> wire.Header:
        if len(self.spill) >= wire.HEADER.size:
            hdr = wire.parse_header(self.spill[:wire.HEADER.size])
            self.spill = self.spill[wire.HEADER.size:]
            return hdr
        got = len(self.spill)
        self.head[:got] = self.spill
        while got < wire.HEADER.size:
            n = self.sock.recv_into(self.head[got:], len(self.head) - got)
            if not n:
                raise ConnectionError("peer closed the connection")
            got += n
        hdr = wire.parse_header(self.head[:wire.HEADER.size])
        self.spill = memoryview(bytes(self.head[wire.HEADER.size:got]))
        return hdr

    def _recv_into(self, view: memoryview) -> None:
        """Fill ``view``: first from bytes already read past the header, then straight from the socket."""
        take = min(len(self.spill), view.nbytes)
        if take:
            view[:take] = self.spill[:take]
            self.spill = self.spill[take:]
        if take < view.nbytes:
            recv_exact_into(self.sock, view[take:])

    def run(self) -> None:
        hello = server_handshake(next_header=self._next_header, read=self._message, send=self.sock.sendall,
                                 engine_id=self.host.engine_id, key_for=self.host.handshake_key, peer=self.peer,
                                 sock=self.sock, deadline=self.deadline)
        self.claim = hello.scope
        if self._authenticated is not None:
            self._authenticated(self.sock)
        # Every read and send from here on gets idle_seconds: a peer that stops sending (or reading) mid-frame
        # or between frames no longer holds a thread and a descriptor for ever (issue 12 finding 7).
        self.sock.settimeout(self.idle_seconds)
        while True:
            try:
                hdr = self._next_header()
            except TimeoutError:
                raise IdleTimeout(f"no frame for {self.idle_seconds:g} s") from None
            if hdr.type is wire.FrameType.WRITE:
                self._write(hdr)
            elif hdr.type is wire.FrameType.READ:
                self._read(hdr)
            elif hdr.type is wire.FrameType.RDMA_CONNECT:
                self._rdma_connect(hdr)
            else:
                raise wire.MalformedFrame(f"unexpected {hdr.type.name} frame from a client")

    def _message(self, size: int) -> bytes:
        buf = bytearray(size)
        self._recv_into(memoryview(buf))
        return bytes(buf)

    def _error(self, frame_id: int, message: str) -> None:
        body = message.encode()[: wire.MAX_MESSAGE]
        self.sock.sendall(wire.pack_header(wire.FrameType.ERROR, frame_id=frame_id, payload_len=len(body)) + body)

    def _extents(self, hdr: wire.Header, *, payload_len: int | None,
                 ) -> tuple[list[wire.Extent], list[memoryview], list[tuple[Any, int, memoryview]], str]:
        """Decode a frame's extents into views of the target segments.

        Device segments get a host bounce view each; the third list says where each bounce
        belongs ``(device buffer, offset, bounce)`` so the caller copies it in or out.
        """
        table = bytearray(hdr.count * wire.EXTENT.size)
        self._recv_into(memoryview(table))
        extents = wire.parse_extents(table, hdr.count, payload_len=payload_len)
        if sum(e.length for e in extents) > wire.MAX_PAYLOAD:
            raise wire.MalformedFrame("extents add up to more than a frame may carry")
        caps = [b""] * len(extents)
        if hdr.flags & wire.FLAG_CAPS:
            raw = bytearray(hdr.caps_len)
            self._recv_into(memoryview(raw))
            caps = wire.parse_capabilities(raw, hdr.count)
        write = hdr.type is wire.FrameType.WRITE
        views: list[memoryview] = []
        staged: list[tuple[Any, int, memoryview]] = []
        for extent, capability in zip(extents, caps, strict=True):
            segment: LocalSegment | None = self.host.served_segment(extent.segment)
            if segment is None:
                return extents, [], [], f"unknown segment {extent.segment} (unregistered or engine restarted)"
            if extent.offset + extent.length > segment.size:
                return extents, [], [], (f"range {extent.offset}+{extent.length} outside segment "
                                         f"{segment.segment_id} of {segment.size} bytes")
            # Before a byte lands or leaves: an agent's engine wants a capability for every extent.
            refused = self.host.authorize(segment, offset=extent.offset, length=extent.length, write=write,
                                          capability=capability, claim=self.claim)
            if refused:
                log.warning("tcp one-sided request refused peer=%s scope=%s segment=%s reason=%r", self.peer,
                            self.claim, segment.segment_id, refused)
                return extents, [], [], f"not authorized: {refused}"
            if segment.buffer is not None:
                views.append(segment.buffer[extent.offset:extent.offset + extent.length])
            elif self.host.runtime is not None and segment.device is not None:
                bounce = memoryview(bytearray(extent.length))
                views.append(bounce)
                staged.append((segment.transport_state["device_buffer"], extent.offset, bounce))
            else:
                return extents, [], [], f"segment {segment.segment_id} is device memory and no runtime can stage it"
        return extents, views, staged, ""

    def _write(self, hdr: wire.Header) -> None:
        extents, views, staged, problem = self._extents(hdr, payload_len=hdr.payload_len)
        if problem:
            # well-formed frame, wrong target: skip its payload and keep the connection
            scratch = memoryview(bytearray(min(_DRAIN, max(1, hdr.payload_len))))
            left = hdr.payload_len
            while left:
                chunk = min(left, len(scratch))
                self._recv_into(scratch[:chunk])
                left -= chunk
            self._error(hdr.frame_id, problem)
            return
        for view in views:
            self._recv_into(view)
        if hdr.flags & wire.FLAG_CRC:
            for extent, view in zip(extents, views, strict=True):
                if crc32c.crc32c(view) != extent.crc:
                    self._error(hdr.frame_id, f"crc32c mismatch in slice at offset {extent.offset}")
                    return
        try:
            for device, offset, bounce in staged:
                self.host.runtime.copy_to_device(device, bounce, offset=offset)
        except Exception as exc:
            self._error(hdr.frame_id, f"copy into device memory failed: {exc}")
            return
        self.sock.sendall(wire.pack_header(wire.FrameType.ACK, frame_id=hdr.frame_id))

    def _read(self, hdr: wire.Header) -> None:
        extents, views, staged, problem = self._extents(hdr, payload_len=None)
        if not problem:
            try:
                for device, offset, bounce in staged:
                    self.host.runtime.copy_to_host(bounce, device, offset=offset)
            except Exception as exc:
                problem = f"copy out of device memory failed: {exc}"
        if problem:
            self._error(hdr.frame_id, problem)
            return
        crc = bool(hdr.flags & wire.FLAG_CRC)
        answer = [wire.Extent(e.segment, e.offset, e.length, crc32c.crc32c(v) if crc else 0)
                  for e, v in zip(extents, views, strict=True)]
        total = sum(e.length for e in extents)
        head = wire.pack_header(wire.FrameType.DATA, frame_id=hdr.frame_id, count=len(answer), payload_len=total,
                                flags=hdr.flags & wire.FLAG_CRC)
        send_all(self.sock, [head + wire.pack_extents(answer), *views])

    def _rdma_connect(self, hdr: wire.Header) -> None:
        request = self._message(hdr.payload_len)
        rdma = self.host.find_transport("rdma")
        if rdma is None:
            self._error(hdr.frame_id, "rdma is not enabled on this engine")
            return
        if self.host.checks_capabilities and self.claim != ADMIN:
            # A queue pair reaches whole registered regions through the NIC, past any per-request check:
            # until grants map to memory windows, only the pool secret gets one (the client falls back to tcp).
            self._error(hdr.frame_id, f"rdma connect refused: scope {self.claim} reaches this agent's segments "
                                      "only through capability-checked tcp (docs/security.md)")
            return
        try:
            answer = rdma.accept(json.loads(request))
        except Exception as exc:
            self._error(hdr.frame_id, f"rdma connect refused: {exc}")
            return
        body = json.dumps(answer).encode()
        self.sock.sendall(wire.pack_header(wire.FrameType.RDMA_CONNECT, frame_id=hdr.frame_id,
                                           payload_len=len(body)) + body)
