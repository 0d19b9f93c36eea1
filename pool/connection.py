"""One authenticated, blocking connection to a store agent: the request/reply half of the wire protocol.

Used by the client library and by agents talking to each other (heartbeats,
handoff, pull-through). Data sections are sent with ``sendmsg`` straight from
the caller's buffers and received with ``recv_into`` straight into them. NOT
THREAD-SAFE: one request at a time per connection.
"""

from __future__ import annotations

import itertools
import socket
import ssl
from collections.abc import Sequence

from daybreak.errors import DaybreakError
from daybreak.pool import credentials
from daybreak.pool import protocol as p
from daybreak.pool.handshake import AuthenticationFailed, Challenge, Hello, client_hello
from daybreak.pool.sockets import recv_exact_into, send_all


class RemoteError(DaybreakError):
    """The agent answered with an ERROR frame (the text says why)."""


def parse_address(address: str, *, default_port: int = 7480) -> tuple[str, int]:
    """``host:port`` (or ``host``) to a tuple; raises ValueError naming the address."""
    host, sep, port = address.rpartition(":")
    if not sep:
        return address, default_port
    try:
        number = int(port)
    except ValueError:
        raise ValueError(f"address {address!r}: port {port!r} is not a number") from None
    if not 0 < number < 65536:
        raise ValueError(f"address {address!r}: port {number} out of range")
    return host.strip("[]") or "127.0.0.1", number


class Connection:
    """A connected, authenticated socket to one agent."""

    def __init__(self, address: str, *, token: bytes, timeout_seconds: float = 30.0, client: str = "",
                 tls: ssl.SSLContext | None = None) -> None:
        """``token``: a credential (``pool/credentials.py``: the pool secret, an agent or a namespace credential).

        Raises AuthenticationFailed (the agent did not prove this pool's key) or RemoteError (it refused ours).
        """
        self.address = address
        self.scope, key = credentials.parse(token.decode(errors="replace"))
        host, port = parse_address(address)
        raw = socket.create_connection((host, port), timeout=timeout_seconds)
        raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            # TLS (docs/security.md): the agent's certificate is checked against ``tls``'s CAs and the host.
            self.sock = tls.wrap_socket(raw, server_hostname=host) if tls is not None else raw
        except BaseException:
            raw.close()
            raise
        self._ids = itertools.count(1)
        try:
            self.hello = client_hello(_HelloChannel(self), key=key, scope=self.scope.claim, identity=client)
        except BaseException:
            self.sock.close()
            raise

    def close(self) -> None:
        self.sock.close()

    # -- framing ---------------------------------------------------------------------------------

    def _send(self, op: p.Op, meta: bytes, *, flags: int = 0,
              data: Sequence[memoryview] = ()) -> int:
        rid = next(self._ids) & 0xFFFFFFFF
        total = sum(len(d) for d in data)
        send_all(self.sock, [*p.frame(op, meta, flags=flags, request_id=rid, data_len=total), *data])
        return rid

    def _reply(self, rid: int) -> tuple[p.Header, bytearray]:
        header, meta = p.read_frame(self.sock)
        if header.op == p.Op.ERROR:
            raise RemoteError(f"{self.address}: {p.TextReply.decode(meta).text}")
        if header.op != p.Op.REPLY or header.request_id != rid:
            raise p.ProtocolError(f"{self.address}: unexpected {header.op.name} frame for request {rid}")
        return header, meta

    def _call(self, op: p.Op, meta: bytes, *, flags: int = 0,
              data: Sequence[memoryview] = ()) -> tuple[p.Header, bytearray]:
        return self._reply(self._send(op, meta, flags=flags, data=data))

    def _blocks(self, op: p.Op, meta: bytes, *, flags: int = 0,
                data: Sequence[memoryview] = ()) -> p.BlocksReply:
        header, raw = self._call(op, meta, flags=flags, data=data)
        if header.data_len:
            raise p.ProtocolError(f"{self.address}: unexpected data section on {op.name} reply")
        return p.BlocksReply.decode(raw)

    # -- operations ------------------------------------------------------------------------------

    def put(self, keys: Sequence[str], views: Sequence[memoryview], checksums: Sequence[int], *,
            flags: int = 0, pin_seconds: int = 0, tier: int = 0) -> list[p.BlockInfo]:
        """Store blocks; one BlockInfo per key (status OK when stored)."""
        meta = p.PutRequest(list(keys), [len(v) for v in views], list(checksums), pin_seconds, tier).encode()
        return self._blocks(p.Op.PUT, meta, flags=flags, data=views).blocks

    def get_into(self, keys: Sequence[str], views: Sequence[memoryview], *, flags: int = 0) -> list[p.BlockInfo]:
        """Fetch blocks into ``views`` (bytes land at the start of each view); statuses per key."""
        rid = self._send(p.Op.GET, p.KeysRequest(list(keys), [len(v) for v in views]).encode(), flags=flags)
        header, raw = self._reply(rid)
        reply = p.BlocksReply.decode(raw)
        if len(reply.blocks) != len(keys):
            raise p.ProtocolError(f"{self.address}: {len(reply.blocks)} results for {len(keys)} keys")
        expected = 0
        for info, view in zip(reply.blocks, views, strict=True):
            if info.status == p.Status.OK:
                if info.size > len(view):
                    raise p.ProtocolError(f"{self.address}: block of {info.size} bytes for a {len(view)}-byte buffer")
                expected += info.size
        if header.data_len != expected:
            raise p.ProtocolError(f"{self.address}: data section {header.data_len} bytes, expected {expected}")
        for info, view in zip(reply.blocks, views, strict=True):
            if info.status == p.Status.OK and info.size:
                recv_exact_into(self.sock, view[:info.size])
        return reply.blocks

    def exists(self, keys: Sequence[str], *, flags: int = 0) -> list[p.BlockInfo]:
        return self._blocks(p.Op.EXISTS, p.KeysRequest(list(keys)).encode(), flags=flags).blocks

    def remove(self, keys: Sequence[str]) -> list[p.BlockInfo]:
        return self._blocks(p.Op.REMOVE, p.KeysRequest(list(keys)).encode()).blocks

    def report(self, keys: Sequence[str]) -> list[p.BlockInfo]:
        return self._blocks(p.Op.REPORT, p.KeysRequest(list(keys)).encode()).blocks

    def locate(self, keys: Sequence[str], *, flags: int = 0) -> p.BlocksReply:
        """Same-node read: segment and offset per key plus a lease id to RELEASE after copying."""
        return self._blocks(p.Op.LOCATE, p.KeysRequest(list(keys)).encode(), flags=flags)

    def release(self, lease_id: int) -> None:
        """One-way: no reply is read."""
        self._send(p.Op.RELEASE, p.LeaseRequest(lease_id).encode())

    def alloc(self, keys: Sequence[str], sizes: Sequence[int], checksums: Sequence[int], *,
              pin_seconds: int = 0) -> p.BlocksReply:
        """Same-node write: reserve space; copy into the returned (segment, offset) and COMMIT."""
        meta = p.AllocRequest(list(keys), list(sizes), list(checksums), pin_seconds).encode()
        return self._blocks(p.Op.ALLOC, meta)

    def commit(self, reservation_id: int, *, abort: bool = False, flags: int = 0) -> list[p.BlockInfo]:
        return self._blocks(p.Op.COMMIT, p.LeaseRequest(reservation_id).encode(),
                            flags=flags | (p.FLAG_ABORT if abort else 0)).blocks

    def segments(self) -> list[p.SegmentEntry]:
        """The agent's segments registered with its transfer engine (empty when it runs none)."""
        _, raw = self._call(p.Op.SEGMENTS, b"")
        return p.SegmentsReply.decode(raw).segments

    def xlocate(self, keys: Sequence[str], *, flags: int = 0) -> p.BlocksReply:
        """Engine read: (segment id, offset) per key, a lease id to RELEASE after the transfer, and a READ
        capability per block (``BlocksReply.capability(i)``) for the engine to send with its request."""
        return self._blocks(p.Op.XLOCATE, p.KeysRequest(list(keys)).encode(), flags=flags)

    def xalloc(self, keys: Sequence[str], sizes: Sequence[int], checksums: Sequence[int], *, tier: int = 0,
               pin_seconds: int = 0, agent_crc: bool = False) -> p.BlocksReply:
        """Engine write: reserve space (zeroed by the agent); transfer into the returned (segment id, offset)
        with the block's WRITE capability (``BlocksReply.capability(i)``), then COMMIT (which revokes it)."""
        meta = p.PutRequest(list(keys), list(sizes), list(checksums), pin_seconds, tier).encode()
        return self._blocks(p.Op.XALLOC, meta, flags=p.FLAG_AGENT_CRC if agent_crc else 0)

    def record(self, holder: str, keys: Sequence[str]) -> list[p.BlockInfo]:
        """Tell a key's home that ``holder`` has the block (local-first writes)."""
        return self._blocks(p.Op.RECORD, p.RecordRequest(holder, list(keys)).encode()).blocks

    def members(self) -> list[p.Member]:
        _, raw = self._call(p.Op.MEMBERS, b"")
        return p.MembersReply.decode(raw).members

    def ping(self, me: p.Member) -> list[p.Member]:
        """Tell a peer we are alive (and whether we are leaving); returns its view of the pool."""
        _, raw = self._call(p.Op.PING, p.MembersReply([me]).encode())
        return p.MembersReply.decode(raw).members

    def flush_namespace(self, namespace: str) -> p.FlushReply:
        """Delete every block of ``namespace`` on this agent (pool secret, or that namespace's credential)."""
        _, raw = self._call(p.Op.FLUSH_NAMESPACE, p.NamespaceRequest(namespace).encode())
        return p.FlushReply.decode(raw)

    def stats(self) -> dict[str, str]:
        _, raw = self._call(p.Op.STATS, b"")
        text = p.TextReply.decode(raw).text
        return dict(line.split("=", 1) for line in text.splitlines() if "=" in line)


class _HelloChannel:
    """The store protocol's handshake (``pool.handshake.ClientChannel``): two HELLO frames, two replies."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self._rid = 0

    def send_hello(self, hello: Hello) -> None:
        self._rid = self._conn._send(p.Op.HELLO, p.Hello(hello.identity, hello.scope, hello.nonce).encode())

    def recv_challenge(self) -> Challenge:
        _, meta = self._conn._reply(self._rid)  # an ERROR frame (a refusal) raises RemoteError
        challenge = p.HelloChallenge.decode(meta)
        return Challenge(challenge.nonce, challenge.proof)

    def send_proof(self, proof: bytes) -> None:
        self._rid = self._conn._send(p.Op.HELLO, p.HelloProof(proof).encode())

    def recv_accept(self) -> p.HelloReply:
        _, meta = self._conn._reply(self._rid)
        return p.HelloReply.decode(meta)


__all__ = ["AuthenticationFailed", "Connection", "RemoteError", "parse_address"]
