"""The transfer engine's control connection: the HELLO handshake and one-shot control exchanges.

Every tcp connection between engines opens with a HELLO each way (the pool
token and the engine ids, as JSON payloads of ``wire`` frames); the decision
is ``daybreak.pool.handshake``'s, shared with the store protocol. rdma
queue-pair set-up rides on the same server as a request/answer exchange on a
fresh connection (``control_request``).
"""

from __future__ import annotations

import json
import socket
from collections.abc import Callable
from typing import Any

from daybreak.agent.transfer import wire
from daybreak.errors import DaybreakError
from daybreak.pool.handshake import AuthenticationFailed, Hello, client_hello, server_accept
from daybreak.pool.sockets import recv_exact_into


class PeerError(DaybreakError):
    """The peer answered ERROR for a frame: the request is wrong for it, not the path."""


def parse_endpoint(endpoint: str, *, field_name: str) -> tuple[str, int]:
    """``host:port`` (``[v6]:port``) to a tuple; ValueError naming ``field_name`` otherwise."""
    host, sep, port = endpoint.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"{field_name}: expected host:port, got {endpoint!r}")
    return host.strip("[]") or "0.0.0.0", int(port)


def _read_frame(sock: socket.socket) -> tuple[wire.Header, bytearray]:
    header = bytearray(wire.HEADER.size)
    recv_exact_into(sock, memoryview(header))
    hdr = wire.parse_header(header)
    payload = bytearray(hdr.payload_len)
    recv_exact_into(sock, memoryview(payload))
    return hdr, payload


class _ClientHello:
    """``pool.handshake.ClientChannel`` over a fresh socket: HELLO out, HELLO (or ERROR) back."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock

    def send_hello(self, hello: Hello) -> None:
        body = json.dumps({"engine_id": hello.identity, "token": hello.token.decode()}).encode()
        self._sock.sendall(wire.pack_header(wire.FrameType.HELLO, frame_id=0, payload_len=len(body)) + body)

    def recv_accept(self) -> str:
        hdr, payload = _read_frame(self._sock)
        if hdr.type is wire.FrameType.ERROR:
            raise ValueError(payload.decode(errors="replace"))
        if hdr.type is not wire.FrameType.HELLO:
            raise wire.MalformedFrame(f"expected HELLO, got {hdr.type.name}")
        peer: str = json.loads(payload).get("engine_id", "")
        return peer


def client_handshake(sock: socket.socket, *, engine_id: str, token: str) -> str:
    """Client side of HELLO; returns the peer's engine id (ValueError when it refuses)."""
    return client_hello(_ClientHello(sock), token=token.encode(), identity=engine_id)


class _ServerHello:
    """``pool.handshake.ServerChannel`` over a server connection's reader (which may have read ahead)."""

    def __init__(self, *, next_header: Callable[[], wire.Header], read: Callable[[int], bytes],
                 send: Callable[[bytes], None]) -> None:
        self._next_header = next_header
        self._read = read
        self._send = send

    def recv_hello(self) -> Hello:
        hdr = self._next_header()
        if hdr.type is not wire.FrameType.HELLO:
            raise wire.MalformedFrame(f"expected HELLO first, got {hdr.type.name}")
        raw = self._read(hdr.payload_len)
        try:
            hello = json.loads(raw)
            token, engine_id = hello.get("token", ""), hello.get("engine_id", "")
        except (ValueError, AttributeError):
            raise wire.MalformedFrame("HELLO payload is not a JSON object") from None
        if not isinstance(token, str):
            self.send_refusal("wrong pool token")
            raise AuthenticationFailed("HELLO token is not a string")
        return Hello(token.encode(), str(engine_id))

    def send_refusal(self, reason: str) -> None:
        body = b"bad token: this engine serves another pool"
        self._send(wire.pack_header(wire.FrameType.ERROR, frame_id=0, payload_len=len(body)) + body)


def server_handshake(*, next_header: Callable[[], wire.Header], read: Callable[[int], bytes],
                     send: Callable[[bytes], None], engine_id: str, token: str, peer: str) -> Hello:
    """Server side of HELLO: check the token, answer with our engine id; MalformedFrame closes the connection."""
    try:
        hello = server_accept(_ServerHello(next_header=next_header, read=read, send=send), token=token.encode())
    except AuthenticationFailed:
        raise wire.MalformedFrame(f"bad token from {peer}") from None
    body = json.dumps({"engine_id": engine_id}).encode()
    send(wire.pack_header(wire.FrameType.HELLO, frame_id=0, payload_len=len(body)) + body)
    return hello


def control_request(endpoint: str, kind: wire.FrameType, message: dict[str, Any], *, engine_id: str, token: str,
                    timeout_s: float) -> dict[str, Any]:
    """One request/answer exchange on a fresh connection (rdma queue-pair set-up rides on this).

    Raises ``OSError`` when the peer cannot be reached and ``PeerError`` when it refuses.
    """
    address = parse_endpoint(endpoint, field_name="tcp_endpoint")
    with socket.create_connection(address, timeout=max(0.05, timeout_s)) as sock:
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
