"""The transfer engine's tcp server under issue 12 findings 6 and 7: connection caps and the idle timeout.

The capped engine runs in this process (its server is real sockets and threads); the well-behaved client
it must keep serving is a separate peer process. Two loopback addresses (127.0.0.1 and 127.0.0.2) play
two peer addresses.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
from collections.abc import Iterator

import pytest

from daybreak.agent.transfer import EngineConfig, TransferEngine, wire
from daybreak.pool.admission import Caps
from daybreak.pool.handshake import Hello, _proof
from daybreak.testing.transfer_peer import PeerProcess, pattern

TOKEN = "pool-secret"
FLOOD_HOST = "127.0.0.2"


def _authenticated(address: tuple[str, int], *, source: str) -> socket.socket:
    """A raw connection from ``source`` that completes the engine's challenge-response, then sits there."""
    sock = socket.create_connection(address, timeout=10, source_address=(source, 0))

    def send(message: dict[str, str]) -> None:
        body = json.dumps(message).encode()
        sock.sendall(wire.pack_header(wire.FrameType.HELLO, frame_id=0, payload_len=len(body)) + body)

    def answer() -> tuple[wire.Header, bytes]:
        raw = sock.recv(wire.HEADER.size, socket.MSG_WAITALL)
        if len(raw) < wire.HEADER.size:
            raise ConnectionError("the engine closed the connection during the handshake")
        hdr = wire.parse_header(raw)
        return hdr, sock.recv(hdr.payload_len, socket.MSG_WAITALL) if hdr.payload_len else b""

    nonce = os.urandom(16)
    send({"engine_id": "idle", "scope": "admin", "nonce": nonce.hex()})
    _, body = answer()
    challenge = json.loads(body)
    send({"proof": _proof(TOKEN.encode(), b"client", Hello("idle", "admin", nonce),
                          bytes.fromhex(challenge["nonce"])).hex()})
    hdr, _ = answer()
    assert hdr.type is wire.FrameType.HELLO, f"handshake refused: {hdr.type.name}"
    return sock


def _closed_by_server(sock: socket.socket, *, within: float) -> bool:
    sock.settimeout(within)
    try:
        return sock.recv(1) == b""
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True


@pytest.fixture
def peer() -> Iterator[PeerProcess]:
    proc = PeerProcess(segment_bytes=1 << 20, node=f"peer-{os.getpid()}", transports="tcp", token=TOKEN)
    yield proc
    proc.close()


def _peer_writes(peer: PeerProcess, engine: TransferEngine, memory: bytearray, seed: int) -> None:
    """The peer process dials ``engine`` and writes 64 KiB of its pattern into ``memory``: byte-exact."""
    size = 64 << 10
    peer.fill(seed, 0, size)
    rid = peer.open(engine.register_segment(memory, name=f"kv-{seed}").descriptor.to_json())
    answer = peer.batch([("write", rid, 0, 0, size)], timeout_s=30)
    assert [a["status"] for a in answer] == ["completed"], answer
    assert memory[:size] == pattern(seed, size)


def test_engine_refuses_past_its_per_address_cap_and_keeps_serving_others(peer: PeerProcess) -> None:
    caps = Caps(max_connections=64, max_connections_per_address=3)
    with TransferEngine(node="capped", transports=("tcp",), token=TOKEN, caps=caps) as engine:
        address = engine.register_segment(bytearray(4096), name="probe").descriptor.tcp_address
        held = [_authenticated(address, source=FLOOD_HOST) for _ in range(caps.max_connections_per_address)]
        try:
            extra = socket.create_connection(address, timeout=10, source_address=(FLOOD_HOST, 0))
            with extra:
                assert _closed_by_server(extra, within=10), "the (cap+1)th connection from one address was kept"
            # Another address is not affected: the peer process (127.0.0.1) connects and writes byte-exact.
            _peer_writes(peer, engine, bytearray(1 << 20), seed=5)
            # A closed connection leaves the count: the flood address gets a slot again.
            held.pop().close()
            deadline = time.monotonic() + 20
            while True:
                try:
                    held.append(_authenticated(address, source=FLOOD_HOST))
                    break
                except OSError:  # still counted: the server thread has not seen the close yet
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.2)
        finally:
            for sock in held:
                sock.close()


def test_engine_refuses_past_its_total_cap() -> None:
    caps = Caps(max_connections=2, max_connections_per_address=2)
    with TransferEngine(node="capped", transports=("tcp",), token=TOKEN, caps=caps) as engine:
        address = engine.register_segment(bytearray(4096), name="probe").descriptor.tcp_address
        with _authenticated(address, source="127.0.0.1"), _authenticated(address, source=FLOOD_HOST), \
                socket.create_connection(address, timeout=10, source_address=("127.0.0.3", 0)) as third:
            assert _closed_by_server(third, within=10), "a connection past the engine's total cap was kept"


def test_idle_authenticated_engine_connection_is_closed(peer: PeerProcess) -> None:
    with TransferEngine(node="idle", transports=("tcp",), token=TOKEN, idle_seconds=1.0) as engine:
        memory = bytearray(1 << 20)
        _peer_writes(peer, engine, memory, seed=3)
        address = engine.register_segment(bytearray(4096), name="probe").descriptor.tcp_address
        with contextlib.closing(_authenticated(address, source="127.0.0.1")) as idle:
            assert _closed_by_server(idle, within=20), "an idle authenticated connection was never closed"
        # The peer's own connections went idle too and were closed: its next batch reconnects and lands.
        _peer_writes(peer, engine, memory, seed=4)


def test_engine_limits_are_checked() -> None:
    with pytest.raises(ValueError, match="max_connections_per_address"):
        Caps(max_connections_per_address=0)
    with pytest.raises(ValueError, match="idle_seconds"):
        TransferEngine(idle_seconds=0)


def test_agent_engine_takes_the_stores_connection_settings() -> None:
    from daybreak.agent.settings import AgentSettings

    settings = AgentSettings(listen="127.0.0.1:0", max_connections=9, max_connections_per_address=4,
                             idle_seconds=7.5)
    engine = TransferEngine.from_config(EngineConfig.for_agent(settings, token=TOKEN))
    assert (engine.caps.max_connections, engine.caps.max_connections_per_address, engine.idle_seconds) == (9, 4, 7.5)
