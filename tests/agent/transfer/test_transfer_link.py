"""The link transport between two processes through the real Sunrise runtime path (ctypes over the
gcc-built test libraries, whose device memory is memfd-backed and whose IPC handles open in other processes)."""

from __future__ import annotations

import hashlib
import json
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from sunrise_lib.build import build, node
from support import layout as pack

from daybreak.agent.runtime.base import DeviceBuffer
from daybreak.agent.runtime.sunrise import SunriseRuntime
from daybreak.agent.transfer import Status, TransferEngine, TransferRequest, metrics
from daybreak.testing.transfer_peer import PeerProcess, pattern

MiB = 1 << 20
BUSES = ["0000:12:00.0", "0000:13:00.0", "0000:03:00.0", "0000:04:00.0"]
# chips 0-1 and 2-3 with two ports each, 0-2 with one
LINKS = [[0, 0, 1, 0], [0, 1, 1, 1], [2, 0, 3, 0], [2, 1, 3, 1], [0, 2, 2, 2]]
SIZES = [1, 7, 4096, 65_537, MiB + 3, 16 * MiB, 64 * MiB]


@pytest.fixture(scope="module")
def libdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build(tmp_path_factory.mktemp("sunrise-lib"))


@pytest.fixture
def runtime(libdir: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[SunriseRuntime]:
    monkeypatch.setenv("DAYBREAK_FAKE_SUNRISE", node(BUSES, links=LINKS, memory_bytes=2 << 30))
    monkeypatch.delenv("DAYBREAK_FAKE_SUNRISE_FAIL", raising=False)
    rt = SunriseRuntime.load(lib_dir=str(libdir))
    yield rt
    rt.close()


@pytest.fixture
def peers() -> Iterator[list[PeerProcess]]:
    started: list[PeerProcess] = []
    yield started
    for peer in started:
        peer.close()


def _peer(peers: list[PeerProcess], libdir: Path, *, node_name: str, size: int, device: int) -> PeerProcess:
    peer = PeerProcess(segment_bytes=size, node=node_name, transports="link,shm,tcp", device=device,
                       runtime="sunrise", sunrise_lib_dir=str(libdir))
    peers.append(peer)
    return peer


def _device_sha(rt: SunriseRuntime, buf: DeviceBuffer, offset: int, length: int) -> str:
    out = bytearray(length)
    rt.copy_to_host(out, buf, offset=offset)
    return hashlib.sha256(out).hexdigest()


def test_link_moves_mixed_sizes_device_to_device(runtime: SunriseRuntime, libdir: Path,
                                                 peers: list[PeerProcess]) -> None:
    total = sum(s + 4096 for s in SIZES)
    name = f"node-{uuid.uuid4().hex[:6]}"
    peer = _peer(peers, libdir, node_name=name, size=total, device=1)
    descriptor = json.loads(peer.descriptor)
    assert descriptor["kind"] == "device" and descriptor["device"]["ipc_handle"]
    local_buf = runtime.allocate(0, total)
    try:
        with TransferEngine(node=name, runtime=runtime) as engine:
            assert "link" in engine.transports
            local = engine.register_segment(local_buf, name="hbm0")
            remote = engine.open_remote(peer.descriptor)
            assert engine.route(remote) == ("link", "tcp")
            layout = pack(SIZES)
            for i, (off, size) in enumerate(layout):
                runtime.copy_to_device(local_buf, pattern(i + 1, size), offset=off)
            batch = engine.submit([TransferRequest.write(remote, off, local, local_offset=off, length=size)
                                   for off, size in layout], timeout_s=60)
            results = batch.wait()
            assert [r.status for r in results] == [Status.COMPLETED] * len(layout), [r.error for r in results]
            assert {r.transport for r in results} == {"link"}
            for i, (off, size) in enumerate(layout):
                assert peer.hash(off, size) == hashlib.sha256(pattern(i + 1, size)).hexdigest()
            for i, (off, size) in enumerate(layout):
                peer.fill(40 + i, off, size)
            engine.transfer([TransferRequest.read(remote, off, local, local_offset=off, length=size)
                             for off, size in layout], timeout_s=60)
            for i, (off, size) in enumerate(layout):
                assert _device_sha(runtime, local_buf, off, size) == hashlib.sha256(pattern(40 + i, size)).hexdigest()
            # host memory on our side, device memory on theirs: the runtime's H2D/D2H copies
            host = bytearray(pattern(77, 3 * MiB))
            engine.transfer([TransferRequest.write(remote, 0, host)])
            assert peer.hash(0, 3 * MiB) == hashlib.sha256(host).hexdigest()
    finally:
        runtime.free(local_buf)


def test_failing_link_falls_back_to_tcp_through_host_memory(runtime: SunriseRuntime, libdir: Path,
                                                            peers: list[PeerProcess],
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    name = f"node-{uuid.uuid4().hex[:6]}"
    peer = _peer(peers, libdir, node_name=name, size=32 * MiB, device=3)
    local_buf = runtime.allocate(2, 32 * MiB)
    try:
        runtime.copy_to_device(local_buf, pattern(5, 32 * MiB))
        with TransferEngine(node=name, runtime=runtime) as engine:
            local = engine.register_segment(local_buf, name="hbm2")
            remote = engine.open_remote(peer.descriptor)
            # from here on this process's peer copies fail inside the runtime library
            monkeypatch.setenv("DAYBREAK_FAKE_SUNRISE_FAIL", "tangMemcpyPeer=719")
            fallbacks = metrics.FALLBACKS.labels("link", "tcp")._value.get()
            results = engine.submit([TransferRequest.write(remote, 0, local)], timeout_s=30).wait()
            assert results[0].status is Status.COMPLETED, results[0].error
            assert results[0].transport == "tcp"
            assert metrics.FALLBACKS.labels("link", "tcp")._value.get() == fallbacks + 1
            assert peer.hash(0, 32 * MiB) == hashlib.sha256(pattern(5, 32 * MiB)).hexdigest()
            peer.fill(6, 0, 32 * MiB)
            results = engine.submit([TransferRequest.read(remote, 0, local)], timeout_s=30).wait()
            assert results[0].status is Status.COMPLETED and results[0].transport == "tcp", results[0].error
            assert _device_sha(runtime, local_buf, 0, 32 * MiB) == hashlib.sha256(pattern(6, 32 * MiB)).hexdigest()
    finally:
        monkeypatch.delenv("DAYBREAK_FAKE_SUNRISE_FAIL", raising=False)
        runtime.free(local_buf)


def test_one_gib_kv_set_over_the_link(runtime: SunriseRuntime, libdir: Path, peers: list[PeerProcess]) -> None:
    name = f"node-{uuid.uuid4().hex[:6]}"
    peer = _peer(peers, libdir, node_name=name, size=1 << 30, device=1)
    chunk, block = 256 * MiB, 4 * MiB
    local_buf = runtime.allocate(0, chunk)
    try:
        with TransferEngine(node=name, runtime=runtime) as engine:
            local = engine.register_segment(local_buf, name="hbm0")
            remote = engine.open_remote(peer.descriptor)
            expected = []
            for round_ in range(4):
                data = pattern(500 + round_, chunk)
                runtime.copy_to_device(local_buf, data)
                expected.append(hashlib.sha256(data).hexdigest())
                results = engine.transfer([TransferRequest.write(remote, round_ * chunk + off, local, local_offset=off,
                                                                 length=block) for off in range(0, chunk, block)],
                                          timeout_s=120)
                assert {r.transport for r in results} == {"link"}
                assert peer.hash(round_ * chunk, chunk) == expected[-1]
            for round_ in range(4):
                runtime.copy_to_device(local_buf, bytes(chunk))
                engine.transfer([TransferRequest.read(remote, round_ * chunk + off, local, local_offset=off,
                                                      length=block) for off in range(0, chunk, block)],
                                timeout_s=120)
                assert _device_sha(runtime, local_buf, 0, chunk) == expected[round_]
    finally:
        runtime.free(local_buf)
