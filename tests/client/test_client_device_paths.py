"""Device buffers through the client (issue 20 item 2): the path each agent gets, byte-exact, with no bounce.

Device memory is the Sunrise stand-in's (tests/sunrise_lib: memfd-backed "HBM" reached through the real
ctypes runtime), which also counts whether each host<->device copy touched registered (pinned) or pageable
host memory. Same-node agents are real agent processes on real sockets; "other nodes" over rdma are engines
with different node names in this process, because the fake verbs move bytes by address (one address space);
the tcp-staged path runs against a real agent process from an engine on another node name. Nothing here ran
on a GPU or an RDMA NIC.
"""

from __future__ import annotations

import hashlib
import logging
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from sunrise_lib.build import build, counters, node

from daybreak.agent.runtime.base import DeviceBuffer
from daybreak.agent.runtime.sunrise import SunriseRuntime
from daybreak.agent.store.datapath import StoreDataPath
from daybreak.agent.store.engine import BlockStore, StoreConfig
from daybreak.agent.store.server import StoreServer
from daybreak.agent.topology import discover
from daybreak.agent.transfer import TransferEngine, metrics
from daybreak.agent.transfer.paths import TopologyView
from daybreak.client import KVPoolClient
from daybreak.pool import shm as pool_shm
from daybreak.testing.store_agent import LocalAgent, free_port

MiB = 1 << 20
SIZES = [MiB, 4 * MiB + 17, 65_537]
TOTAL = sum(SIZES)
BUSES = ["0000:12:00.0", "0000:13:00.0"]
SYSFS = Path(__file__).resolve().parents[1] / "fixtures" / "sysfs"


@pytest.fixture(scope="module")
def libdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build(tmp_path_factory.mktemp("sunrise-lib"))


@pytest.fixture
def runtime(libdir: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[SunriseRuntime]:
    monkeypatch.setenv("DAYBREAK_FAKE_SUNRISE", node(BUSES, links=[[0, 0, 1, 0]], memory_bytes=1 << 30))
    monkeypatch.delenv("DAYBREAK_FAKE_SUNRISE_FAIL", raising=False)
    rt = SunriseRuntime.load(lib_dir=str(libdir))
    yield rt
    rt.close()



def _agent(pool: dict[str, Any], libdir: Path, monkeypatch: pytest.MonkeyPatch, *, hbm: bool) -> LocalAgent:
    """A real agent process; with ``hbm`` it loads the Sunrise stand-in and serves a 32 MiB HBM tier."""
    if hbm:
        monkeypatch.setenv("DAYBREAK_SUNRISE_LIB_DIR", str(libdir))
        monkeypatch.setenv("DAYBREAK_RUNTIME", "sunrise")
    agent = LocalAgent(address=f"127.0.0.1:{free_port()}", token_file=pool["token_file"], pool=pool["name"],
                       dram="64Mi", extra=["--hbm", "32Mi"] if hbm else [])
    pool["agents"].append(agent)
    agent.start()
    monkeypatch.delenv("DAYBREAK_RUNTIME", raising=False)
    assert agent.wait_log("event=preflight transport=tcp works=True"), agent.log[-2000:]
    if hbm:
        assert agent.wait_log("event=preflight transport=link works=True"), agent.log[-2000:]
    return agent


def _token(pool: dict[str, Any]) -> str:
    return Path(pool["token_file"]).read_text().strip()


def _device_blocks(rt: SunriseRuntime, seed: int, *, device: int = 0) -> tuple[list[DeviceBuffer], list[str]]:
    bufs, digests = [], []
    for i, n in enumerate(SIZES):
        payload = np.random.default_rng(seed * 100 + i).integers(0, 256, n, dtype=np.uint8).tobytes()
        buf = rt.allocate(device, n)
        rt.copy_to_device(buf, memoryview(payload))
        bufs.append(buf)
        digests.append(hashlib.sha256(payload).hexdigest())
    return bufs, digests


def _digests(rt: SunriseRuntime, bufs: list[DeviceBuffer]) -> list[str]:
    out = []
    for buf in bufs:
        host = bytearray(buf.size)
        rt.copy_to_host(host, buf)
        out.append(hashlib.sha256(host).hexdigest())
    return out


def _paths(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("event=datapath ")]


def _fallback_metric(preferred: str, used: str, reason: str) -> float:
    value: float = metrics.FALLBACK_REASONS.labels(preferred, used, reason)._value.get()
    return value


def test_device_blocks_take_the_link_into_hbm_and_one_pinned_dma_into_dram(
        pool: dict[str, Any], libdir: Path, runtime: SunriseRuntime, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="daybreak.client")
    agent = _agent(pool, libdir, monkeypatch, hbm=True)
    src, want = _device_blocks(runtime, 1)
    dst = [runtime.allocate(0, n) for n in SIZES]
    with TransferEngine(token=_token(pool), runtime=runtime) as engine, \
            KVPoolClient([agent.address], token=_token(pool), namespace="ns", engine=engine) as c:
        before = counters(libdir)
        assert c.batch_put(["h0", "h1", "h2"], src, tier="hbm") == [1, 1, 1]
        assert c.batch_put(["d0", "d1", "d2"], src, tier="dram") == [1, 1, 1]
        assert c.batch_get_into(["h0", "h1", "h2"], dst) == SIZES
        mid = counters(libdir)  # (the digests' own copies are pageable: read the counters around the moves)
        assert _digests(runtime, dst) == want
        for buf in dst:
            runtime.copy_to_device(buf, bytes(buf.size))
        again = counters(libdir)
        assert c.batch_get_into(["d0", "d1", "d2"], dst) == SIZES
        after = counters(libdir)
        assert _digests(runtime, dst) == want
        # HBM by the device link, DRAM by one DMA each way straight into the agent's mapped segment
        assert engine.bytes_used == {"link": 2 * TOTAL, "shm": 2 * TOTAL}
        assert engine.bytes_staged == {} and engine.bytes_fell_back == {}  # no bounce buffer, no fallback
        moved = (mid["pinned_bytes"] - before["pinned_bytes"]) + (after["pinned_bytes"] - again["pinned_bytes"])
        assert moved == 2 * TOTAL  # the DRAM put's D2H and get's H2D, each into or out of pinned memory ...
        assert mid["pageable_copies"] == before["pageable_copies"]  # ... and not one pageable copy
        assert after["pageable_copies"] == again["pageable_copies"]
        pinned = after["registrations"] - before["registrations"]
        assert pinned == engine.pinned_ranges >= 1  # the mapped DRAM segments the blocks landed in
        # a second round registers nothing new: pinned once per mapping, never per move
        assert c.batch_put(["e0", "e1", "e2"], src, tier="dram") == [1, 1, 1]
        assert c.batch_get_into(["e0", "e1", "e2"], dst) == SIZES
        assert counters(libdir)["registrations"] == after["registrations"]
        assert engine.bytes_staged == {}
        stats = next(iter(c._conns.values())).stats()
        assert stats["blocks_hbm"] == "3"
        paths = _paths(caplog)
        assert len([m for m in paths if " path=link " in m]) == 1, paths  # once per agent and path
        assert len([m for m in paths if " path=shm-dma " in m]) == 1, paths
    # The agent checksummed what landed one-sided (FLAG_AGENT_CRC): a host reader over the stream verifies it.
    with KVPoolClient([agent.address], token=_token(pool), namespace="ns", transport="tcp") as c:
        for keys in (["h0", "h1", "h2"], ["d0", "d1", "d2"]):
            host = [bytearray(n) for n in SIZES]
            assert c.batch_get_into(keys, host) == SIZES
            assert [hashlib.sha256(h).hexdigest() for h in host] == want
    for buf in src + dst:
        runtime.free(buf)


def test_a_failing_device_path_falls_back_staged_and_is_counted_with_its_reason(
        pool: dict[str, Any], libdir: Path, runtime: SunriseRuntime, monkeypatch: pytest.MonkeyPatch,
        tmp_path: Path) -> None:
    agent = _agent(pool, libdir, monkeypatch, hbm=True)
    src, want = _device_blocks(runtime, 2)
    dst = [runtime.allocate(0, n) for n in SIZES]
    with TransferEngine(token=_token(pool), runtime=runtime) as engine, \
            KVPoolClient([agent.address], token=_token(pool), namespace="ns", engine=engine) as c:
        # this process cannot open the agent's HBM IPC handles any more: the link into HBM is broken
        monkeypatch.setenv("DAYBREAK_FAKE_SUNRISE_FAIL", "tangIpcOpenMemHandle=719")
        failed_before = _fallback_metric("link", "tcp", metrics.PATH_FAILED)
        assert c.batch_put(["h0", "h1", "h2"], src, tier="hbm") == [1, 1, 1]
        assert c.batch_get_into(["h0", "h1", "h2"], dst) == SIZES
        assert _digests(runtime, dst) == want
        link = {k: n for k, n in engine.fallback_reasons.items() if k[:2] == ("link", "tcp")}
        assert sum(link.values()) == 2 * TOTAL  # every byte fell back, with its reason ...
        assert link.get(("link", "tcp", metrics.PATH_FAILED), 0) > 0  # (the breaker trips later ones: "tripped")
        assert set(link) <= {("link", "tcp", metrics.PATH_FAILED), ("link", "tcp", metrics.TRIPPED)}
        assert _fallback_metric("link", "tcp", metrics.PATH_FAILED) > failed_before  # ... on the metrics too
        assert engine.bytes_staged == {"tcp": 2 * TOTAL}  # tcp last: through the pinned staging pool
        assert engine.staging.areas == 1
        monkeypatch.delenv("DAYBREAK_FAKE_SUNRISE_FAIL")
        # this process can no longer map the agent's /dev/shm: the DMA into the DRAM segment is broken
        monkeypatch.setattr(pool_shm, "SHM_DIR", tmp_path / "no-shm-here")
        for buf in dst:
            runtime.copy_to_device(buf, bytes(buf.size))
        assert c.batch_put(["d0", "d1", "d2"], src, tier="dram") == [1, 1, 1]
        assert c.batch_get_into(["d0", "d1", "d2"], dst) == SIZES
        assert _digests(runtime, dst) == want
        shm = {k: n for k, n in engine.fallback_reasons.items() if k[:2] == ("shm", "tcp")}
        assert sum(shm.values()) == 2 * TOTAL and ("shm", "tcp", metrics.PATH_FAILED) in shm
        assert engine.bytes_staged == {"tcp": 4 * TOTAL}
    for buf in src + dst:
        runtime.free(buf)


def test_tcp_is_last_and_staged_then_the_stores_stream_when_the_engine_cannot_move_them(
        pool: dict[str, Any], libdir: Path, runtime: SunriseRuntime, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="daybreak.client")
    agent = _agent(pool, libdir, monkeypatch, hbm=False)
    src, want = _device_blocks(runtime, 3)
    dst = [runtime.allocate(0, n) for n in SIZES]
    elsewhere = f"other-node-{uuid.uuid4().hex[:6]}"  # not the agent's node: no shm, no link
    with TransferEngine(node=elsewhere, transports=("tcp",), token=_token(pool), runtime=runtime) as engine, \
            KVPoolClient([agent.address], token=_token(pool), namespace="ns", engine=engine) as c:
        before = counters(libdir)
        assert c.batch_put(["t0", "t1", "t2"], src) == [1, 1, 1]
        assert c.batch_get_into(["t0", "t1", "t2"], dst) == SIZES
        after = counters(libdir)
        assert _digests(runtime, dst) == want
        assert engine.bytes_used == {"tcp": 2 * TOTAL} and engine.bytes_staged == {"tcp": 2 * TOTAL}
        assert after["pageable_copies"] == before["pageable_copies"]  # staged into pinned chunks only
        assert after["pinned_bytes"] - before["pinned_bytes"] == 2 * TOTAL
        assert any(" path=tcp-staged " in m for m in _paths(caplog))
        # the engine's tcp breaks: device buffers go over the store's stream, staged, and it is counted
        engine.transport("tcp").start = lambda jobs: [  # type: ignore[method-assign]
            engine.job_path_failed(j, "injected: connection refused", transport="tcp") for j in jobs]
        metric_before = _fallback_metric("tcp", "stream", "engine_failed")
        for buf in dst:
            runtime.copy_to_device(buf, bytes(buf.size))
        assert c.batch_put(["s0", "s1", "s2"], src) == [1, 1, 1]
        assert c.batch_get_into(["s0", "s1", "s2"], dst) == SIZES
        assert _digests(runtime, dst) == want
        assert engine.fallback_reasons[("tcp", "stream", "engine_failed")] == 2 * TOTAL
        assert _fallback_metric("tcp", "stream", "engine_failed") == metric_before + 2
        assert any(" path=stream-staged " in m for m in _paths(caplog))
    with KVPoolClient([agent.address], token=_token(pool), namespace="ns", transport="tcp") as c:
        host = [bytearray(n) for n in SIZES]
        assert c.batch_get_into(["s0", "s1", "s2"], host) == SIZES
        assert [hashlib.sha256(h).hexdigest() for h in host] == want
    for buf in src + dst:
        runtime.free(buf)


@pytest.mark.parametrize(("fixture", "path"), [("dgx8", "rdma-gdr"), ("box4", "rdma-staged")])
def test_device_blocks_cross_nodes_over_rdma_gdr_where_a_nic_shares_the_switch_else_staged(
        fixture: str, path: str, runtime: SunriseRuntime, libdir: Path, caplog: pytest.LogCaptureFixture) -> None:
    """dgx8: GPU0 and mlx5_0 under one PCIe switch, so device 0's memory is registered with the NIC (GDR);
    box4: no GPU shares a switch with its NIC, so slices stage through the engine's pinned staging pool."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "agent" / "transfer"))
    from test_transfer_rdma import Fabric, fake_verbs  # the rdma tests' fake of the pyverbs surface

    caplog.set_level(logging.INFO, logger="daybreak.client")
    fabric = Fabric()
    tag = uuid.uuid4().hex[:6]
    token = f"rdma-device-{tag}"
    prefix = f"daybreak-tdev{tag}-x"
    store = BlockStore(StoreConfig(prefix=prefix, dram_bytes=64 * MiB))
    store.open()
    agent_engine = TransferEngine(node=f"agent-{tag}", transports=("rdma", "tcp"), token=token,
                                  verbs=fake_verbs(fabric, ["a0", "a1"])).start()
    datapath = StoreDataPath(store=store, engine=agent_engine, own_engine=True)
    datapath.register()
    server = StoreServer(store, listen=f"127.0.0.1:{free_port()}", token=token.encode(), pool=f"tdev{tag}",
                         datapath=datapath)
    server.start()
    view = TopologyView.from_topology(discover(SYSFS / fixture))
    src, want = _device_blocks(runtime, 4)
    dst = [runtime.allocate(0, n) for n in SIZES]
    try:
        with TransferEngine(node=f"client-{tag}", transports=("rdma", "tcp"), token=token, runtime=runtime,
                            verbs=fake_verbs(fabric, ["mlx5_0"]), topology=view) as engine, \
                KVPoolClient([server.address], token=token, namespace="ns", engine=engine) as c:
            before = counters(libdir)
            assert c.batch_put(["r0", "r1", "r2"], src) == [1, 1, 1]
            assert c.batch_get_into(["r0", "r1", "r2"], dst) == SIZES
            after = counters(libdir)
            assert _digests(runtime, dst) == want
            assert engine.bytes_used == {"rdma": 2 * TOTAL}
            registered = {m.address for m in fabric.mrs.values()}
            if path == "rdma-gdr":  # the NIC read and wrote device memory itself: nothing crossed host memory
                assert engine.bytes_staged == {}
                assert {b.address for b in src + dst} <= registered
                assert after["pinned_copies"] == before["pinned_copies"]
            else:  # one pinned, NIC-registered staging area; device memory never registered with the NIC
                assert engine.bytes_staged == {"rdma": 2 * TOTAL} and engine.staging.areas == 1
                assert not {b.address for b in src + dst} & registered
                assert after["pinned_bytes"] - before["pinned_bytes"] == 2 * TOTAL
            assert after["pageable_copies"] == before["pageable_copies"]
            assert [m for m in _paths(caplog) if f" path={path} " in m], _paths(caplog)
            # the agent checksummed what landed (FLAG_AGENT_CRC): a host reader verifies it
            host = [bytearray(n) for n in SIZES]
            assert c.batch_get_into(["r0", "r1", "r2"], host) == SIZES
            assert [hashlib.sha256(h).hexdigest() for h in host] == want
    finally:
        server.close()
        store.close(unlink=True)
        for leftover in pool_shm.SHM_DIR.glob(f"{prefix}-*"):  # the server's probe segment
            leftover.unlink(missing_ok=True)
        for buf in src + dst:
            runtime.free(buf)
