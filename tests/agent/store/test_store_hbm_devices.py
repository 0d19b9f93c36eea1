"""The HBM tier on every device the agent serves (stand-in Sunrise runtime with two devices)."""

from __future__ import annotations

import uuid
from pathlib import Path

import httpx
import pytest
from sunrise_lib.build import build, node

from daybreak.agent.runtime.sunrise import SunriseRuntime
from daybreak.agent.store.engine import BlockStore, Reservation, StoreConfig
from daybreak.agent.store.tiers import HbmTier
from daybreak.client import KVPoolClient
from daybreak.pool.checksum import crc32c
from daybreak.testing.store_agent import LocalAgent, cleanup_pool, free_port

BUSES = ["0000:12:00.0", "0000:13:00.0"]
MiB = 1 << 20


@pytest.fixture(scope="module")
def libdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build(tmp_path_factory.mktemp("sunrise-lib"))


def test_a_store_with_two_devices_has_a_tier_on_each_and_places_blocks_on_both(
        libdir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DAYBREAK_FAKE_SUNRISE", node(BUSES, memory_bytes=64 * MiB))
    rt = SunriseRuntime.load(lib_dir=str(libdir))
    assert [d.index for d in rt.devices()] == [0, 1]
    pool = f"h{uuid.uuid4().hex[:8]}"
    hbm = HbmTier(runtime=rt, devices=[0, 1], capacity=4 * MiB)
    store = BlockStore(StoreConfig(prefix=f"daybreak-{pool}-x", dram_bytes=8 * MiB, policy="lru", hbm=hbm))
    store.open()
    try:
        assert hbm.capacity == 2 * 4 * MiB and store.usage()["hbm"] == 0 and store.tiers["hbm"].capacity == 8 * MiB
        data = [bytes([i + 1]) * MiB for i in range(4)]
        for i, d in enumerate(data):
            res = store.reserve(f"ns/h{i}", len(d), crc32c(d), tier="hbm")
            assert isinstance(res, Reservation) and res.tier == "hbm"
            store.write_hbm(res, memoryview(d))
            store.commit([res])
        blocks = {b.key: b for b in store.keys()}
        assert {b.tier for b in blocks.values()} == {"hbm"}
        assert {b.segment for b in blocks.values()} == {0, 1}  # the block's placement names its device
        assert hbm.used_per_device() == {0: 2 * MiB, 1: 2 * MiB}
        for i, d in enumerate(data):
            (block,) = store.acquire([f"ns/h{i}"])
            assert block is not None
            out = bytearray(len(d))
            store.read_hbm_into(block, memoryview(out))
            store.release([block])
            assert bytes(out) == d
    finally:
        store.close(unlink=True)
        cleanup_pool(pool)


def test_an_agent_with_two_devices_serves_bytes_per_device_on_each(
        libdir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DAYBREAK_FAKE_SUNRISE", node(BUSES, memory_bytes=64 * MiB))
    monkeypatch.setenv("DAYBREAK_SUNRISE_LIB_DIR", str(libdir))
    pool = f"h{uuid.uuid4().hex[:8]}"
    metrics_port = free_port()
    agent = LocalAgent(address=f"127.0.0.1:{free_port()}", token_file=tmp_path / "token", pool=pool, dram="16Mi",
                       extra=["--hbm", "8Mi", "--metrics-port", str(metrics_port)])
    try:
        agent.start()
        assert agent.wait_log("event=hbm_tier devices=0,1 bytes_per_device=8388608 bytes=16777216"), agent.log[-2000:]
        with KVPoolClient(endpoints=[agent.address], token=agent.token_file.read_text().strip(),
                          namespace="ns") as c:
            data = [bytes([i + 1]) * (512 << 10) for i in range(6)]
            keys = [f"d{i}" for i in range(6)]
            assert c.batch_put(keys, data, tier="hbm") == [1] * 6
            out = [bytearray(512 << 10) for _ in data]
            assert c.batch_get_into(keys, out) == [512 << 10] * 6 and [bytes(o) for o in out] == data
        text = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).text
        assert 'daybreak_store_capacity_bytes{tier="hbm"} 1.6777216e+07' in text  # 2 devices x 8 MiB
        assert 'daybreak_store_hits_total{tier="hbm"} 6.0' in text
    finally:
        agent.kill()
        cleanup_pool(pool)
