"""Transfer engine end to end: two engines in separate processes on loopback, over shm and tcp."""

from __future__ import annotations

import asyncio
import hashlib
import os
import signal
import socket
import time
import uuid
from collections.abc import Iterator

import pytest
from support import layout as pack

from daybreak.agent.transfer import (
    RemoteSegment,
    ShmSegment,
    Status,
    TransferEngine,
    TransferError,
    TransferRequest,
    metrics,
)
from daybreak.testing.transfer_peer import PeerProcess, pattern

MiB = 1 << 20
# 1 byte to 64 MiB, with odd sizes that straddle slice and page boundaries
SIZES = [1, 7, 4096, 65_537, MiB + 3, 4 * MiB - 1, 16 * MiB, 64 * MiB]


def _sha(data: bytes | bytearray | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()


def _unique(prefix: str) -> str:
    return f"{prefix}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def peer_factory() -> Iterator[list[PeerProcess]]:
    peers: list[PeerProcess] = []
    yield peers
    for peer in peers:
        peer.close()
        for name in (peer.shm_name,):
            if name:
                ShmSegment.path_of(name).unlink(missing_ok=True)


def _start(peers: list[PeerProcess], **kwargs: object) -> PeerProcess:
    peer = PeerProcess(**kwargs)  # type: ignore[arg-type]
    peers.append(peer)
    return peer


@pytest.fixture
def engine() -> Iterator[TransferEngine]:
    with TransferEngine(node=_unique("local"), transports=("shm", "tcp")) as eng:
        yield eng


@pytest.mark.parametrize("transport,checksum", [("tcp", False), ("tcp", True), ("shm", False)])
def test_mixed_sizes_arrive_byte_exact(peer_factory: list[PeerProcess], transport: str, checksum: bool) -> None:
    total = sum(s + 4096 for s in SIZES)
    shm_name = _unique("dbt-mixed")
    node = _unique("node")
    peer = _start(peer_factory, segment_bytes=total, shm_name=shm_name, node=node, checksum=checksum)
    # same node name -> shm first; another node name -> tcp
    local_node = node if transport == "shm" else _unique("other")
    with TransferEngine(node=local_node, transports=("shm", "tcp"), checksum=checksum) as engine:
        remote = engine.open_remote(peer.descriptor)
        assert engine.route(remote)[0] == transport
        layout = pack(SIZES)
        sources = [pattern(i + 1, size) for i, (_, size) in enumerate(layout)]
        batch = engine.submit([TransferRequest.write(remote, off, src) for (off, _), src in zip(layout, sources, strict=True)],
                              timeout_s=60)
        results = batch.wait()
        assert [r.status for r in results] == [Status.COMPLETED] * len(SIZES), [r.error for r in results]
        assert {r.transport for r in results} == {transport}
        for (off, size), src in zip(layout, sources, strict=True):
            assert peer.hash(off, size) == _sha(src), f"WRITE of {size} bytes at {off} differs"
        # and back: the peer fills with other patterns, we READ them into fresh buffers
        for i, (off, size) in enumerate(layout):
            peer.fill(100 + i, off, size)
        sinks = [bytearray(size) for _, size in layout]
        engine.transfer([TransferRequest.read(remote, off, sink) for (off, _), sink in zip(layout, sinks, strict=True)],
                        timeout_s=60)
        for i, ((off, size), sink) in enumerate(zip(layout, sinks, strict=True)):
            assert _sha(sink) == _sha(pattern(100 + i, size)) == peer.hash(off, size), f"READ of {size} bytes differs"


def test_same_node_segment_reads_in_place(peer_factory: list[PeerProcess]) -> None:
    shm_name = _unique("dbt-inplace")
    node = _unique("node")
    peer = _start(peer_factory, segment_bytes=MiB, shm_name=shm_name, node=node)
    peer.fill(11, 0, MiB)
    with TransferEngine(node=node, transports=("shm", "tcp")) as engine:
        view = engine.map_remote(engine.open_remote(peer.descriptor))
        assert bytes(view[:MiB]) == pattern(11, MiB)  # zero copies: the peer's pages themselves
    with TransferEngine(node=_unique("elsewhere"), transports=("shm", "tcp")) as engine:
        with pytest.raises(ValueError, match="cannot be mapped here"):
            engine.map_remote(engine.open_remote(peer.descriptor))


def test_asyncio_await_and_local_segment_offsets(peer_factory: list[PeerProcess], engine: TransferEngine) -> None:
    peer = _start(peer_factory, segment_bytes=8 * MiB, node=_unique("far"))
    local = engine.register_segment(bytearray(8 * MiB), name="staging")
    assert local.buffer is not None
    local.buffer[MiB:2 * MiB] = pattern(7, MiB)
    remote = engine.open_remote(peer.descriptor)

    async def go() -> None:
        results = await engine.submit([TransferRequest.write(remote, 3 * MiB, local, local_offset=MiB, length=MiB)])
        assert results[0].status is Status.COMPLETED
        results = await engine.submit([TransferRequest.read(remote, 3 * MiB, local, local_offset=5 * MiB,
                                                            length=MiB)])
        assert results[0].status is Status.COMPLETED

    asyncio.run(go())
    assert peer.hash(3 * MiB, MiB) == _sha(pattern(7, MiB))
    assert bytes(local.buffer[5 * MiB:6 * MiB]) == pattern(7, MiB)


def test_bad_requests_name_the_field(peer_factory: list[PeerProcess], engine: TransferEngine) -> None:
    peer = _start(peer_factory, segment_bytes=MiB, node=_unique("far"))
    remote = engine.open_remote(peer.descriptor)
    with pytest.raises(ValueError, match=r"requests\[0\]\.remote_offset"):
        engine.submit([TransferRequest.write(remote, MiB - 10, bytes(11))])
    with pytest.raises(ValueError, match=r"requests\[1\]\.local: READ needs a writable buffer"):
        engine.submit([TransferRequest.write(remote, 0, bytes(1)), TransferRequest.read(remote, 0, b"x")])
    with pytest.raises(ValueError, match=r"requests\[0\]\.length"):
        engine.submit([TransferRequest.read(remote, 0, bytearray(10), local_offset=5, length=6)])
    with pytest.raises(ValueError, match="field 'size'"):
        engine.open_remote('{"segment_id": "a/b", "engine_id": "a", "node": "n", "size": 0}')
    with pytest.raises(ValueError, match="field 'tcp_endpoint'"):
        engine.open_remote({"segment_id": "a/b", "engine_id": "a", "node": "n", "size": 1, "tcp_endpoint": 5})


def test_unknown_segment_fails_without_fallback(peer_factory: list[PeerProcess], engine: TransferEngine) -> None:
    peer = _start(peer_factory, segment_bytes=MiB, node=_unique("far"))
    import json

    forged = json.loads(peer.descriptor)
    forged["tcp_handle"] = 999
    forged["segment_id"] += "-forged"
    remote = engine.open_remote(forged)
    results = engine.submit([TransferRequest.read(remote, 0, bytearray(10))], timeout_s=10).wait()
    assert results[0].status is Status.FAILED
    assert "unknown segment 999" in results[0].error
    # the connection survived the bad request: a good one on the same peer works
    good = engine.open_remote(peer.descriptor)
    engine.transfer([TransferRequest.write(good, 0, b"hello")])
    assert peer.hash(0, 5) == _sha(b"hello")


def test_killed_peer_fails_in_flight_requests_before_the_deadline(peer_factory: list[PeerProcess]) -> None:
    peer = _start(peer_factory, segment_bytes=64 * MiB, node=_unique("far"))
    with TransferEngine(node=_unique("local"), transports=("tcp",), slice_bytes=MiB) as engine:
        remote = engine.open_remote(peer.descriptor)
        source = pattern(3, 64 * MiB)
        # ~4 GiB of writes: far more than moves before the kill lands
        requests = [TransferRequest.write(remote, 0, source) for _ in range(64)]
        batch = engine.submit(requests, timeout_s=120)
        while not any(r.status is Status.COMPLETED for r in batch.results) and not batch.done():
            batch.wait(timeout_s=0.01)
        os.kill(peer.proc.pid, signal.SIGKILL)
        results = batch.wait()
    statuses = {r.status for r in results}
    assert Status.PENDING not in statuses
    # failed, not timed out: the dead peer was noticed, the 120 s deadline was not needed
    failed = [r for r in results if r.status is Status.FAILED]
    assert failed, "the kill landed after the whole batch completed"
    assert Status.TIMEOUT not in statuses
    assert all("tcp" in r.error and ("lost" in r.error or "connect" in r.error or "closed" in r.error)
               for r in failed), failed[0].error
    with pytest.raises(TransferError, match="did not complete"):
        batch.raise_for_status()


def test_hung_peer_times_out_at_the_deadline(peer_factory: list[PeerProcess]) -> None:
    peer = _start(peer_factory, segment_bytes=64 * MiB, node=_unique("far"))
    with TransferEngine(node=_unique("local"), transports=("tcp",)) as engine:
        remote = engine.open_remote(peer.descriptor)
        engine.transfer([TransferRequest.write(remote, 0, b"warm")])  # connections up
        os.kill(peer.proc.pid, signal.SIGSTOP)
        try:
            sink = bytearray(64 * MiB)
            batch = engine.submit([TransferRequest.read(remote, 0, sink), TransferRequest.write(remote, 0, sink)],
                                  timeout_s=1.5)
            results = batch.wait()
        finally:
            os.kill(peer.proc.pid, signal.SIGCONT)
    assert [r.status for r in results] == [Status.TIMEOUT, Status.TIMEOUT]
    assert "deadline" in results[0].error


def test_forced_shm_failure_falls_back_to_tcp_and_trips_the_path(peer_factory: list[PeerProcess]) -> None:
    shm_name = _unique("dbt-fallback")
    node = _unique("node")
    peer = _start(peer_factory, segment_bytes=4 * MiB, shm_name=shm_name, node=node)
    # the segment name disappears from /dev/shm: the peer still holds it, tcp still reaches it,
    # but a new shm mapping cannot be made
    ShmSegment.path_of(shm_name).unlink()
    trips_before = metrics.PATH_TRIPS.labels("shm")._value.get()
    with TransferEngine(node=node, transports=("shm", "tcp")) as engine:
        remote = engine.open_remote(peer.descriptor)
        assert engine.route(remote) == ("shm", "tcp")
        for i in range(engine.breaker.threshold + 1):
            data = pattern(i, MiB)
            results = engine.submit([TransferRequest.write(remote, i * MiB, data)], timeout_s=10).wait()
            assert results[0].status is Status.COMPLETED, results[0].error
            assert results[0].transport == "tcp"
            assert peer.hash(i * MiB, MiB) == _sha(data)
        key = ("shm", remote.descriptor.engine_id)
        tripped, left = engine.breaker.snapshot()[key]
        assert tripped and left > 0
    assert metrics.PATH_TRIPS.labels("shm")._value.get() == trips_before + 1


def _move_gib(engine: TransferEngine, remote: RemoteSegment, peer: PeerProcess) -> None:
    """Write 1 GiB in 64 x 4 MiB blocks per round (4 rounds from one 256 MiB buffer), then read it all back."""
    chunk, block = 256 * MiB, 4 * MiB
    buffer = bytearray(chunk)
    expected = []
    for round_ in range(4):
        buffer[:] = random_bytes(round_, chunk)
        base = round_ * chunk
        engine.transfer([TransferRequest.write(remote, base + off, buffer, local_offset=off, length=block)
                         for off in range(0, chunk, block)], timeout_s=120)
        expected.append(_sha(buffer))
        assert peer.hash(base, chunk) == expected[-1], f"round {round_} differs at the peer"
    for round_ in range(4):
        buffer[:] = bytes(8) * (chunk // 8)
        engine.transfer([TransferRequest.read(remote, round_ * chunk + off, buffer, local_offset=off, length=block)
                         for off in range(0, chunk, block)], timeout_s=120)
        assert _sha(buffer) == expected[round_], f"round {round_} read back differs"


def random_bytes(seed: int, length: int) -> bytes:
    return pattern(seed + 1000, length)


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_one_gib_kv_set_moves_between_processes(peer_factory: list[PeerProcess], transport: str) -> None:
    shm_name = _unique("dbt-gib")
    node = _unique("node")
    peer = _start(peer_factory, segment_bytes=1 << 30, shm_name=shm_name, node=node)
    with TransferEngine(node=node if transport == "shm" else _unique("other"), transports=("shm", "tcp")) as engine:
        remote = engine.open_remote(peer.descriptor)
        assert engine.route(remote)[0] == transport
        _move_gib(engine, remote, peer)


def test_engine_out_of_descriptors_backs_off_and_keeps_serving(peer_factory: list[PeerProcess],
                                                               capfd: pytest.CaptureFixture[str]) -> None:
    # Issue 12 finding 6 for the engine's tcp server: at the fd limit it used to leave its accept loop for good.
    peer = _start(peer_factory, segment_bytes=MiB, node=_unique("peer"), transports="tcp",
                  prefix=["prlimit", "--nofile=48:48"])
    with TransferEngine(node=_unique("local"), transports=("tcp",)) as engine:
        remote = engine.open_remote(peer.descriptor)
        host, port = remote.descriptor.tcp_address
        flood = []
        try:
            for _ in range(80):  # more than the peer has descriptors left: its accept() fails with EMFILE
                flood.append(socket.create_connection((host, port), timeout=5))
            deadline = time.monotonic() + 20
            while not (out_of_fds := "event=accept_failed server=transfer" in capfd.readouterr().err) and time.monotonic() < deadline:
                time.sleep(0.2)
        finally:
            for sock in flood:
                sock.close()
        engine.transfer([TransferRequest.write(remote, 0, b"still serving")], timeout_s=30)
    assert peer.hash(0, 13) == _sha(b"still serving")
    assert out_of_fds, "the peer never ran out of descriptors: the test did not test anything"
