"""The transfer engine's control connection: the HELLO handshake and one-shot control exchanges.

Every tcp connection between engines opens with the challenge-response of
``daybreak.pool.handshake`` (shared with the store protocol), carried as JSON
payloads of ``wire`` HELLO frames: claim and nonce, challenge, proof, welcome.
The engine token is a credential (``pool/credentials.py``): the pool secret
(scope ``admin``) or a namespace credential (``ns:<name>``), whose key is
proved and never crosses the wire. The server accepts the scope of its own
token, and, when it checks a capability per request (a store agent's engine),
any scope whose key it derives from the pool secret: an engine pod proves its
deployment's namespace credential there, not the pool secret. rdma
queue-pair set-up rides on the same server as a request/answer exchange on a
fresh connection (``control_request``).

With TLS (``pool.tls``, the store's helper and settings) every connection is
wrapped before the HELLO: ``dial`` checks the server's certificate, ``accept``
refuses a plaintext peer with an ERROR frame it can read, then closes.
"""

from __future__ import annotations

import contextlib
import json
import socket
import time
from collections.abc import Callable
from typing import Any

from daybreak.agent.transfer import wire
from daybreak.errors import DaybreakError
from daybreak.pool import credentials
from daybreak.pool.credentials import ADMIN, Scope
from daybreak.pool.handshake import AuthenticationFailed, Challenge, Hello, client_hello, server_accept
from daybreak.pool.sockets import Stream, recv_exact_into
from daybreak.pool.tls import TlsContexts, TlsStream, looks_like_tls


class PeerError(DaybreakError):
    """The peer answered ERROR for a frame: the request is wrong for it, not the path."""


class PlaintextRefused(wire.MalformedFrame):
    """A peer spoke plaintext to an engine that requires TLS; it was told so and the connection closed."""


REQUIRES_TLS = b"this engine requires TLS: a plaintext peer is refused (set tls_cert_file/tls_ca_file as on this pool)"


def dial(address: tuple[str, int], *, timeout_s: float, tls: TlsContexts | None) -> Stream:
    """A connected stream to a peer engine; with ``tls`` its certificate is checked for the host dialled.

    Raises OSError (``ssl.SSLError`` included) when the peer cannot be reached or its certificate is refused.
    """
    raw = socket.create_connection(address, timeout=timeout_s)
    try:
        raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if tls is None:
            return raw
        return TlsStream.client(raw, tls.client, server_hostname=address[0], deadline=time.monotonic() + timeout_s)
    except BaseException:
        raw.close()
        raise


def accept(raw: socket.socket, *, tls: TlsContexts | None, deadline: float, peer: str) -> Stream:
    """The server side of a fresh connection, before the HELLO: plain, or TLS when the engine requires it.

    A plaintext peer of a TLS engine gets one ERROR frame saying so and ``PlaintextRefused``. An engine with a
    client context only (``tls.server`` None: an engine pod toward a TLS pool, no certificate of its own) dials
    TLS and serves nobody: every incoming connection is closed the same way.
    """
    if tls is None:
        return raw
    if tls.server is None:
        _close_gently(raw)
        raise PlaintextRefused(f"peer {peer} refused: this engine dials TLS only and has no certificate to serve with")
    previous = raw.gettimeout()
    raw.settimeout(max(0.001, deadline - time.monotonic()))
    if not looks_like_tls(raw):
        raw.sendall(wire.pack_header(wire.FrameType.ERROR, frame_id=0, payload_len=len(REQUIRES_TLS)) + REQUIRES_TLS)
        _close_gently(raw)
        raise PlaintextRefused(f"plaintext peer {peer} refused: this engine requires TLS")
    stream = TlsStream.server(raw, tls.server, deadline=deadline)
    raw.settimeout(previous)  # the handshake's deadline must not outlive it (it would close idle connections)
    return stream


def parse_endpoint(endpoint: str, *, field_name: str) -> tuple[str, int]:
    """``host:port`` (``[v6]:port``) to a tuple; ValueError naming ``field_name`` otherwise."""
    host, sep, port = endpoint.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"{field_name}: expected host:port, got {endpoint!r}")
    return host.strip("[]") or "0.0.0.0", int(port)


def _close_gently(raw: socket.socket) -> None:
    """Half-close and drop what the peer already sent (its HELLO, a few hundred bytes, at most 1 s).

    Closing with unread bytes makes the kernel send a reset, which can discard our ERROR frame
    before the peer reads it."""
    with contextlib.suppress(OSError):
        raw.shutdown(socket.SHUT_WR)
        raw.settimeout(1.0)
        left = 64 << 10
        while left > 0:
            chunk = raw.recv(min(left, 4096))
            if not chunk:
                break
            left -= len(chunk)


def _read_frame(sock: Stream) -> tuple[wire.Header, bytearray]:
    header = bytearray(wire.HEADER.size)
    recv_exact_into(sock, memoryview(header))
    hdr = wire.parse_header(header)
    payload = bytearray(hdr.payload_len)
    recv_exact_into(sock, memoryview(payload))
    return hdr, payload


# The handshake's messages are a few hundred bytes; anything bigger before authentication is refused.
MAX_HANDSHAKE_PAYLOAD = 1024
HANDSHAKE_SECONDS = 10.0
SCOPE = "admin"


def token_scope(token: str) -> tuple[Scope, bytes]:
    """The scope an engine token claims and the key it proves: a ``dbk1`` credential, else the pool secret (admin).

    An empty token (a test engine) is the admin scope with an empty key, as before credentials.
    """
    if not token.strip():
        return Scope(ADMIN), b""
    return credentials.parse(token)


def _json(payload: bytes | bytearray) -> dict[str, Any]:
    try:
        message = json.loads(payload)
    except ValueError:
        raise wire.MalformedFrame("handshake payload is not JSON") from None
    if not isinstance(message, dict):
        raise wire.MalformedFrame("handshake payload is not a JSON object")
    return message


def _hex(message: dict[str, Any], name: str) -> bytes:
    try:
        return bytes.fromhex(str(message.get(name, "")))
    except ValueError:
        raise wire.MalformedFrame(f"handshake field {name!r} is not hex") from None


class _ClientHello:
    """``pool.handshake.ClientChannel`` over a fresh socket."""

    def __init__(self, sock: Stream) -> None:
        self._sock = sock

    def _send(self, message: dict[str, Any]) -> None:
        body = json.dumps(message).encode()
        self._sock.sendall(wire.pack_header(wire.FrameType.HELLO, frame_id=0, payload_len=len(body)) + body)

    def _recv(self) -> dict[str, Any]:
        hdr, payload = _read_frame(self._sock)
        if hdr.type is wire.FrameType.ERROR:
            raise ValueError(payload.decode(errors="replace"))
        if hdr.type is not wire.FrameType.HELLO:
            raise wire.MalformedFrame(f"expected HELLO, got {hdr.type.name}")
        return _json(payload)

    def send_hello(self, hello: Hello) -> None:
        self._send({"engine_id": hello.identity, "scope": hello.scope, "nonce": hello.nonce.hex()})

    def recv_challenge(self) -> Challenge:
        message = self._recv()
        return Challenge(_hex(message, "nonce"), _hex(message, "proof"))

    def send_proof(self, proof: bytes) -> None:
        self._send({"proof": proof.hex()})

    def recv_accept(self) -> str:
        peer: str = str(self._recv().get("engine_id", ""))
        return peer


def client_handshake(sock: Stream, *, engine_id: str, token: str) -> str:
    """Client side of the handshake; returns the peer's engine id (ValueError when either side refuses)."""
    scope, key = token_scope(token)
    try:
        return client_hello(_ClientHello(sock), key=key, scope=scope.claim, identity=engine_id)
    except AuthenticationFailed as exc:
        raise ValueError(f"bad token: {exc}") from None


class _ServerHello:
    """``pool.handshake.ServerChannel`` over a server connection's reader (which may have read ahead)."""

    def __init__(self, *, next_header: Callable[[], wire.Header], read: Callable[[int], bytes],
                 send: Callable[[bytes], None]) -> None:
        self._next_header = next_header
        self._read = read
        self._send = send

    def _recv(self) -> dict[str, Any]:
        hdr = self._next_header()
        if hdr.type is not wire.FrameType.HELLO:
            raise wire.MalformedFrame(f"expected HELLO first, got {hdr.type.name}")
        if hdr.payload_len > MAX_HANDSHAKE_PAYLOAD:
            raise wire.MalformedFrame(f"HELLO of {hdr.payload_len} bytes exceeds {MAX_HANDSHAKE_PAYLOAD}")
        return _json(self._read(hdr.payload_len))

    def _out(self, message: dict[str, Any]) -> None:
        body = json.dumps(message).encode()
        self._send(wire.pack_header(wire.FrameType.HELLO, frame_id=0, payload_len=len(body)) + body)

    def recv_hello(self) -> Hello:
        hello = self._recv()
        return Hello(str(hello.get("engine_id", "")), str(hello.get("scope", "")), _hex(hello, "nonce"))

    def send_challenge(self, challenge: Challenge) -> None:
        self._out({"nonce": challenge.nonce.hex(), "proof": challenge.proof.hex()})

    def recv_proof(self) -> bytes:
        return _hex(self._recv(), "proof")

    def send_refusal(self, reason: str) -> None:
        body = b"bad token: this engine serves another pool"
        self._send(wire.pack_header(wire.FrameType.ERROR, frame_id=0, payload_len=len(body)) + body)


def server_handshake(*, next_header: Callable[[], wire.Header], read: Callable[[int], bytes],
                     send: Callable[[bytes], None], engine_id: str, key_for: Callable[[str], bytes | None],
                     peer: str, sock: Stream | None = None, deadline: float | None = None) -> Hello:
    """Server side: authenticate the peer, answer with our engine id; MalformedFrame closes the connection.

    ``key_for(claim)``: the key a peer claiming that scope must prove, None to refuse the claim
    (``TransportHost.handshake_key``). Returns the peer's HELLO: ``scope`` is what it proved.
    With ``sock`` the whole exchange runs under one ``HANDSHAKE_SECONDS`` deadline (a peer trickling
    bytes cannot hold the connection), and the socket's previous timeout is restored afterwards.
    ``deadline`` (``time.monotonic()``): the one the TLS handshake already ran under, continued here.
    """
    previous = sock.gettimeout() if sock is not None else None
    started = time.monotonic()
    if deadline is None:
        deadline = started + HANDSHAKE_SECONDS
    if sock is not None:
        sock.settimeout(max(0.001, deadline - started))
    try:
        hello = server_accept(_ServerHello(next_header=next_header, read=read, send=send), key_for=key_for)
    except AuthenticationFailed:
        raise wire.MalformedFrame(f"bad token from {peer}") from None
    if time.monotonic() > deadline:
        raise wire.MalformedFrame(f"handshake from {peer} took longer than {HANDSHAKE_SECONDS:.0f} s")
    body = json.dumps({"engine_id": engine_id}).encode()
    send(wire.pack_header(wire.FrameType.HELLO, frame_id=0, payload_len=len(body)) + body)
    if sock is not None:
        sock.settimeout(previous)
    return hello


def control_request(endpoint: str, kind: wire.FrameType, message: dict[str, Any], *, engine_id: str, token: str,
                    timeout_s: float, tls: TlsContexts | None = None) -> dict[str, Any]:
    """One request/answer exchange on a fresh connection (rdma queue-pair set-up rides on this).

    Raises ``OSError`` when the peer cannot be reached and ``PeerError`` when it refuses.
    """
    address = parse_endpoint(endpoint, field_name="tcp_endpoint")
    sock = dial(address, timeout_s=max(0.05, timeout_s), tls=tls)
    with contextlib.closing(sock):
        try:
            client_handshake(sock, engine_id=engine_id, token=token)
            body = json.dumps(message).encode()
            sock.sendall(wire.pack_header(kind, frame_id=1, payload_len=len(body)) + body)
            hdr, payload = _read_frame(sock)
        except (ValueError, wire.MalformedFrame) as exc:
            raise OSError(f"control exchange with {endpoint} failed: {exc}") from None
    if hdr.type is wire.FrameType.ERROR:
        raise PeerError(payload.decode(errors="replace"))
    if hdr.type is not kind:
        raise OSError(f"control exchange with {endpoint}: expected {kind.name}, got {hdr.type.name}")
    answer: dict[str, Any] = json.loads(payload)
    return answer
