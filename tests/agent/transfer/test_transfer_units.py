"""Transfer engine pieces on their own: wire format, descriptors, circuit breaker, batch handles, and the tcp
server's handling of malformed frames and bad tokens (over real sockets)."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import time

import pytest

from daybreak.agent.transfer import (
    BatchHandle,
    CircuitBreaker,
    EngineConfig,
    NicRegion,
    SegmentDescriptor,
    Status,
    TransferEngine,
    TransferError,
    TransferRequest,
    metrics,
    wire,
)
from daybreak.pool.handshake import Hello, _proof


# -- wire ---------------------------------------------------------------------------------------
def test_header_round_trip_and_rejections() -> None:
    raw = wire.pack_header(wire.FrameType.WRITE, frame_id=7, count=2, payload_len=10, flags=wire.FLAG_CRC)
    assert len(raw) == wire.HEADER.size == 24
    hdr = wire.parse_header(raw)
    assert (hdr.type, hdr.frame_id, hdr.count, hdr.payload_len, hdr.flags) == (wire.FrameType.WRITE, 7, 2, 10, 1)
    bad = {
        "bad magic": b"XX" + raw[2:],
        "unsupported protocol version 9": raw[:2] + bytes([9]) + raw[3:],
        "unknown frame type 99": raw[:3] + bytes([99]) + raw[4:],
        "extent count 1001": wire.HEADER.pack(wire.MAGIC, wire.VERSION, wire.FrameType.WRITE, 0, 1001, 1, 0, 0),
        "READ frame with payload_len=5": wire.pack_header(wire.FrameType.READ, frame_id=1, count=1, payload_len=5),
        "HELLO frame with count=1": wire.pack_header(wire.FrameType.HELLO, frame_id=1, count=1),
    }
    for message, frame in bad.items():
        with pytest.raises(wire.MalformedFrame, match=message):
            wire.parse_header(frame)


def test_extents_must_add_up_to_the_payload() -> None:
    extents = [wire.Extent(1, 0, 10, 5), wire.Extent(2, 4096, 6)]
    raw = wire.pack_extents(extents)
    assert wire.parse_extents(raw, 2, payload_len=16) == extents
    with pytest.raises(wire.MalformedFrame, match="add up to 16, payload_len is 17"):
        wire.parse_extents(raw, 2, payload_len=17)


def test_capability_table_round_trips_and_a_table_that_does_not_add_up_is_malformed() -> None:
    caps = [b"c" * 68, b"", b"d" * 3]
    raw = wire.pack_capabilities(caps)
    assert wire.parse_capabilities(raw, 3) == caps
    head = wire.pack_header(wire.FrameType.READ, frame_id=1, count=3, flags=wire.FLAG_CAPS, caps_len=len(raw))
    assert wire.parse_header(head).caps_len == len(raw)
    for message, (table, count) in {
        "table truncated at entry 2": (raw[:-5], 3),
        "does not fit the table": (raw[:-1], 3),
        "1 bytes after the last capability": (raw + b"x", 3),
    }.items():
        with pytest.raises(wire.MalformedFrame, match=message):
            wire.parse_capabilities(table, count)
    with pytest.raises(wire.MalformedFrame, match="cannot hold 3 capabilities"):
        wire.parse_header(wire.pack_header(wire.FrameType.READ, frame_id=1, count=3, flags=wire.FLAG_CAPS,
                                           caps_len=1 << 20))
    with pytest.raises(wire.MalformedFrame, match="without FLAG_CAPS"):
        wire.parse_header(wire.pack_header(wire.FrameType.WRITE, frame_id=1, count=1, caps_len=70))


# -- descriptors -----------------------------------------------------------------------------------
def test_descriptor_is_small_and_round_trips() -> None:
    d = SegmentDescriptor(segment_id="e1/kv", engine_id="e1", node="n1", size=1 << 30, shm_name="kv",
                          tcp_endpoint="10.0.0.1:7000", tcp_handle=3,
                          rdma=(NicRegion(nic="mlx5_0", gid="fe80::1", addr=1 << 40, rkey=77),
                                NicRegion(nic="mlx5_1", gid="fe80::2", addr=1 << 40, rkey=78)))
    assert len(d.to_bytes()) < 512
    assert SegmentDescriptor.from_bytes(d.to_bytes()) == d
    assert SegmentDescriptor.from_json(d.to_json()).tcp_address == ("10.0.0.1", 7000)


@pytest.mark.parametrize(("raw", "field"), [
    ('{"segment_id": "a/b", "engine_id": "a", "node": "n", "size": -1}', "size"),
    ('{"segment_id": "a/b", "engine_id": "a", "node": "n", "size": 1, "rdma": [{"nic": "x", "addr": 0}]}',
     "rdma.0.rkey"),
    ('{"segment_id": "a/b", "engine_id": "a", "node": "n", "size": 1, "color": "red"}', "color"),
    ('{"version": 2, "segment_id": "a/b", "engine_id": "a", "node": "n", "size": 1}', "version"),
    ("[1, 2]", "JSON object"),
    ("{nope", "not JSON"),
])
def test_bad_descriptors_name_the_field(raw: str, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SegmentDescriptor.from_json(raw)


# -- circuit breaker ---------------------------------------------------------------------------------
class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_breaker_trips_doubles_and_recovers(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level("INFO", logger="daybreak.agent.transfer")
    clock = Clock()
    breaker = CircuitBreaker(threshold=3, base_cooldown_s=1.0, max_cooldown_s=3.0, clock=clock)
    key = ("unit-test-path", "peer-1")
    trips = metrics.PATH_TRIPS.labels("unit-test-path")._value.get()
    recoveries = metrics.PATH_RECOVERIES.labels("unit-test-path")._value.get()
    breaker.failure(key)
    breaker.failure(key)
    assert breaker.allow(key)
    breaker.failure(key, "connection refused")
    assert not breaker.allow(key) and breaker.cooldown_left(key) == 1.0
    assert "transfer path tripped transport=unit-test-path peer=peer-1" in caplog.text
    breaker.failure(key)  # a straggler inside the cool-down changes nothing
    assert breaker.cooldown_left(key) == 1.0
    clock.now += 1.0
    assert breaker.allow(key)  # half-open: one trial
    breaker.failure(key)
    assert breaker.cooldown_left(key) == 2.0  # doubled
    clock.now += 2.0
    breaker.failure(key)
    assert breaker.cooldown_left(key) == 3.0  # capped
    clock.now += 3.0
    breaker.success(key)
    assert breaker.allow(key) and breaker.snapshot()[key] == (False, 0.0)
    assert metrics.PATH_TRIPS.labels("unit-test-path")._value.get() == trips + 3
    assert metrics.PATH_RECOVERIES.labels("unit-test-path")._value.get() == recoveries + 1
    assert "transfer path recovered transport=unit-test-path" in caplog.text


# -- batch handle ---------------------------------------------------------------------------------------
def test_batch_deadline_times_out_pending_requests_sync_and_async() -> None:
    batch = BatchHandle(2, deadline=time.monotonic() + 0.05)
    batch.finish(0, Status.COMPLETED, transport="shm")
    results = batch.wait()
    assert [r.status for r in results] == [Status.COMPLETED, Status.TIMEOUT]
    assert batch.done() and not batch.ok
    with pytest.raises(TransferError, match=r"1 of 2 requests did not complete: #1 timeout"):
        batch.raise_for_status()
    late = BatchHandle(1, deadline=time.monotonic() + 0.05)
    assert asyncio.run(late.wait_async())[0].status is Status.TIMEOUT
    seen: list[BatchHandle] = []
    done = BatchHandle(1, deadline=time.monotonic() + 10)
    done.add_done_callback(seen.append)
    assert done.finish(0, Status.FAILED, error="x") and not done.finish(0, Status.COMPLETED)
    assert seen == [done] and done.results[0].status is Status.FAILED


def test_engine_rejects_bad_settings() -> None:
    with pytest.raises(ValueError, match="transports: unknown"):
        TransferEngine(transports=("tcp", "carrier-pigeon"))
    with pytest.raises(ValueError, match="tcp_connections"):
        TransferEngine(tcp_connections=0)
    with pytest.raises(ValueError, match="slice_bytes"):
        TransferEngine(slice_bytes=10)
    with pytest.raises(RuntimeError, match="not running"):
        TransferEngine().submit([])


def test_engine_from_agent_settings() -> None:
    from daybreak.agent.settings import AgentSettings

    settings = AgentSettings.load(environ={"DAYBREAK_TRANSFER_LISTEN": "127.0.0.1:0", "DAYBREAK_NODE_NAME": "n7",
                                           "DAYBREAK_TRANSFER_CHECKSUM": "true", "DAYBREAK_TRANSFER_CONNECTIONS": "3"})
    with TransferEngine.from_config(EngineConfig.for_agent(settings, token="t")) as engine:
        assert (engine.node, engine.checksum, engine.tcp_connections) == ("n7", True, 3)
        assert engine.tcp_endpoint.startswith("127.0.0.1:")


def test_an_engine_pods_engine_config_comes_from_its_contract() -> None:
    """``EngineConfig.for_engine_pod``: the pool's transports (empty: all), loopback only, the pod's credential
    (never in a repr); TLS toward the agents is test_transfer_tls's."""
    from daybreak.agent.transfer.registry import TRANSPORTS
    from daybreak.api.enginepod import EnginePodEnv

    with pytest.raises(ValueError, match="DAYBREAK_POOL_TOKEN"):
        EngineConfig.for_engine_pod(EnginePodEnv(), token="")
    plain = EngineConfig.for_engine_pod(EnginePodEnv(), token="s3cr3t-xyz", node="n3")
    assert (plain.transports, plain.listen, plain.node, plain.tls) == (TRANSPORTS, "127.0.0.1:0", "n3", None)
    assert "s3cr3t-xyz" not in repr(plain)
    config = EngineConfig.for_engine_pod(EnginePodEnv(transports=["shm", "tcp"]), token="cred")
    assert config.transports == ("shm", "tcp")
    with TransferEngine.from_config(config) as engine:
        assert engine._wanted == ("shm", "tcp") and engine.token == "cred"
        assert engine.tcp_endpoint.startswith("127.0.0.1:")


def test_an_agents_engine_needs_a_token_and_binds_no_wider_than_the_store() -> None:
    from daybreak.agent.settings import AgentSettings

    settings = AgentSettings.load(environ={"DAYBREAK_LISTEN": "127.0.0.3:7480"})
    with pytest.raises(ValueError, match="needs the pool secret"):
        TransferEngine.from_config(EngineConfig.for_agent(settings, token=""))
    with TransferEngine.from_config(EngineConfig.for_agent(settings, token="a-pool-secret")) as engine:
        assert engine.tcp_endpoint.startswith("127.0.0.3:")  # the store's host, not 0.0.0.0


# -- tcp server robustness -------------------------------------------------------------------------------
def _hello(sock: socket.socket, token: str) -> wire.Header:
    """The challenge-response by hand (as ``control.client_handshake`` does); returns the server's last frame."""
    def frame(message: dict[str, str]) -> None:
        body = json.dumps(message).encode()
        sock.sendall(wire.pack_header(wire.FrameType.HELLO, frame_id=0, payload_len=len(body)) + body)

    def answer() -> tuple[wire.Header, bytes]:
        hdr = wire.parse_header(sock.recv(wire.HEADER.size, socket.MSG_WAITALL))
        return hdr, sock.recv(hdr.payload_len, socket.MSG_WAITALL) if hdr.payload_len else b""

    nonce = os.urandom(16)
    frame({"engine_id": "unit", "scope": "admin", "nonce": nonce.hex()})
    _, body = answer()
    challenge = json.loads(body)
    hello = Hello("unit", "admin", nonce)
    frame({"proof": _proof(token.encode(), b"client", hello, bytes.fromhex(challenge["nonce"])).hex()})
    return answer()[0]


def test_malformed_frame_closes_only_that_connection() -> None:
    with TransferEngine(node="server", transports=("tcp",), token="pool-secret") as server, \
            TransferEngine(node="client", transports=("tcp",), token="pool-secret") as client:
        memory = bytearray(1 << 20)
        segment = server.register_segment(memory, name="kv")
        remote = client.open_remote(segment.descriptor)
        client.transfer([TransferRequest.write(remote, 0, b"before")])  # the client's connections are up
        host, port = segment.descriptor.tcp_address
        with socket.create_connection((host, port), timeout=5) as rogue:
            assert _hello(rogue, "pool-secret").type is wire.FrameType.HELLO
            rogue.sendall(b"GARBAGE!" * 3)
            assert rogue.recv(1) == b""  # the server hung up on this connection
        with socket.create_connection((host, port), timeout=5) as stranger:
            assert _hello(stranger, "wrong").type is wire.FrameType.ERROR
            assert stranger.recv(1) == b""
        # everyone else's connections are untouched
        client.transfer([TransferRequest.write(remote, 100, b"after")])
        assert memory[:6] == b"before" and memory[100:105] == b"after"


class _Recording:
    """A socket that keeps a copy of every byte sent: what an on-path observer of plain tcp captures."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.sent: list[bytes] = []

    def sendall(self, data: bytes) -> None:
        self.sent.append(bytes(data))
        self.sock.sendall(data)

    def recv(self, n: int, flags: int = 0) -> bytes:
        return self.sock.recv(n, flags)


def test_captured_engine_handshake_cannot_be_replayed() -> None:
    # Issue 12 finding 5 for the transfer engine's wire protocol (the store's has its own test).
    with TransferEngine(node="server", transports=("tcp",), token="pool-secret") as server:
        address = server.register_segment(bytearray(4096), name="kv").descriptor.tcp_address
        with socket.create_connection(address, timeout=5) as first:
            tap = _Recording(first)
            assert _hello(tap, "pool-secret").type is wire.FrameType.HELLO  # type: ignore[arg-type]
        hello_frame, proof_frame = tap.sent
        assert b"pool-secret" not in b"".join(tap.sent)  # the secret never crosses the wire
        with socket.create_connection(address, timeout=5) as replay:
            replay.sendall(hello_frame)
            hdr = wire.parse_header(replay.recv(wire.HEADER.size, socket.MSG_WAITALL))
            replay.recv(hdr.payload_len, socket.MSG_WAITALL)  # a fresh challenge, not the captured one
            replay.sendall(proof_frame)
            answer = wire.parse_header(replay.recv(wire.HEADER.size, socket.MSG_WAITALL))
            assert answer.type is wire.FrameType.ERROR
            replay.recv(answer.payload_len, socket.MSG_WAITALL)
            assert replay.recv(1) == b""


def test_silent_and_trickling_peers_are_closed_at_the_handshake_deadline(monkeypatch: pytest.MonkeyPatch) -> None:
    # Issue 12 findings 6 and 8 for the engine: one deadline for the whole handshake, not per read.
    from daybreak.agent.transfer import tcp

    monkeypatch.setattr(tcp, "HANDSHAKE_SECONDS", 1.0)
    with TransferEngine(node="server", transports=("tcp",), token="pool-secret") as server:
        address = server.register_segment(bytearray(4096), name="kv").descriptor.tcp_address
        with socket.create_connection(address, timeout=10) as silent, \
                socket.create_connection(address, timeout=10) as trickle:
            started = time.monotonic()
            body = json.dumps({"engine_id": "slow", "scope": "admin", "nonce": os.urandom(16).hex()}).encode()
            frame = wire.pack_header(wire.FrameType.HELLO, frame_id=0, payload_len=len(body)) + body
            closed = False
            for i in range(len(frame)):  # one byte every 0.1 s: 10 s for the whole HELLO if never cut off
                try:
                    trickle.sendall(frame[i:i + 1])
                except OSError:
                    closed = True
                    break
                time.sleep(0.1)
                if time.monotonic() - started > 6:
                    break
            trickle.settimeout(5)
            try:
                closed = closed or trickle.recv(1) == b""
            except TimeoutError:
                pass  # still open: the assertion below says so
            except OSError:  # reset by the server
                closed = True
            assert closed, "a peer trickling its HELLO outlived the handshake deadline"
            assert silent.recv(1) == b""
            assert time.monotonic() - started < 15


def test_an_inline_frame_on_a_dead_connection_is_handed_on_once() -> None:
    """send() on a dead connection requeues the frame itself; the inline path must not queue it again."""
    import threading
    from types import SimpleNamespace

    from daybreak.agent.transfer import tcp

    options = tcp.TcpOptions(listen="127.0.0.1:0", advertise=None, connections=1, slice_bytes=1 << 20, checksum=False)
    peer = tcp._Peer(host=None, options=options, endpoint="127.0.0.1:1")  # type: ignore[arg-type]

    class DeadConn:
        alive = True  # it dies while sending
        send_lock = threading.Lock()

        def send(self, frame: object) -> bool:
            peer.queue.put(frame)  # what _Conn.send does when it finds itself dead
            return False

    peer.conns = [DeadConn()]  # type: ignore[list-item]
    frame = SimpleNamespace(batch=SimpleNamespace(handed_out=False), sync=False)
    assert peer._send_inline(frame)  # type: ignore[arg-type]
    assert peer.queue.qsize() == 1
