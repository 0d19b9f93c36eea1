"""The HBM tier through a real runtime loading path (the gcc-built Sunrise test libraries), metrics, GPU check."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
from sunrise_lib.build import build, node

from daybreak.agent.runtime.sunrise import SunriseRuntime
from daybreak.agent.store.engine import BlockStore, Reservation, StoreConfig
from daybreak.agent.store.tiers import HbmTier
from daybreak.client import KVPoolClient
from daybreak.pool import protocol as p
from daybreak.pool.checksum import crc32c
from daybreak.testing.store_agent import LocalAgent, cleanup_pool, free_port

ROOT = Path(__file__).resolve().parents[3]
BUSES = ["0000:12:00.0", "0000:13:00.0"]


@pytest.fixture(scope="module")
def libdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build(tmp_path_factory.mktemp("sunrise-lib"))


@pytest.fixture
def hbm_store(libdir: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[BlockStore]:
    monkeypatch.setenv("DAYBREAK_FAKE_SUNRISE", node(BUSES, memory_bytes=64 << 20))
    rt = SunriseRuntime.load(lib_dir=str(libdir))
    pool = f"h{uuid.uuid4().hex[:8]}"
    store = BlockStore(StoreConfig(prefix=f"daybreak-{pool}-x", dram_bytes=8 << 20, policy="lru",
                                   high_watermark=0.75, low_watermark=0.5,
                                   hbm=HbmTier(runtime=rt, devices=[0], capacity=4 << 20)))
    store.open()
    yield store
    store.close(unlink=True)
    cleanup_pool(pool)


def test_hbm_put_get_and_demotion_to_dram(hbm_store: BlockStore) -> None:
    store = hbm_store
    data = [np.random.default_rng(i).integers(0, 256, 1 << 20, dtype=np.uint8) for i in range(4)]
    for i, d in enumerate(data):
        res = store.reserve(f"h{i}", d.nbytes, crc32c(d), tier="hbm")
        assert isinstance(res, Reservation) and res.tier == "hbm"
        store.write_hbm(res, memoryview(d))
        store.commit([res])
    tiers = {b.key: b.tier for b in store.keys()}
    # 4 MiB of HBM, high watermark 0.75: the oldest blocks were demoted to DRAM, not dropped.
    assert sorted(tiers.values()).count("dram") >= 1 and "hbm" in tiers.values()
    assert set(tiers) == {f"h{i}" for i in range(4)}
    for i, d in enumerate(data):
        (block,) = store.acquire([f"h{i}"])
        assert block is not None
        out = np.zeros_like(d)
        if block.tier == "hbm":
            store.read_hbm_into(block, memoryview(out))
        else:
            out[:] = np.frombuffer(store.view(block), np.uint8)
        store.release([block])
        assert np.array_equal(out, d) and crc32c(out) == block.checksum


@pytest.mark.parametrize("tier", ["hbm", "dram"])
def test_a_cleared_reservation_holds_none_of_the_removed_blocks_bytes(hbm_store: BlockStore, tier: str) -> None:
    """Issue 22 finding 1 on both memory tiers: the extent a removed block leaves is zeroed before a writer
    the agent does not watch (XALLOC, ALLOC) is handed it."""
    store = hbm_store
    secret = b"VICTIM-SECRET-KV" * (1 << 16)  # 1 MiB
    res = store.reserve("victim/b", len(secret), crc32c(secret), tier=tier)
    assert isinstance(res, Reservation) and res.tier == tier
    tier_memory = store.hbm if tier == "hbm" else store.dram
    assert tier_memory is not None
    tier_memory.write_extent(res.segment, res.offset, memoryview(secret))
    store.commit([res])
    assert store.remove(["victim/b"]) == [p.Status.OK]
    again = store.reserve("attacker/r", len(secret), crc32c(bytes(len(secret))), tier=tier)
    assert isinstance(again, Reservation) and (again.segment, again.offset) == (res.segment, res.offset)
    out = bytearray(len(secret))
    tier_memory.read_extent(again.segment, again.offset, memoryview(out))
    assert bytes(out) == secret  # the residue is there before clearing: what the attack read
    store.clear([again])
    tier_memory.read_extent(again.segment, again.offset, memoryview(out))
    assert again.cleared and not any(out)
    store.commit([again], ok=False)


def test_agent_with_hbm_tier_serves_clients(libdir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DAYBREAK_FAKE_SUNRISE", node(BUSES, memory_bytes=64 << 20))
    monkeypatch.setenv("DAYBREAK_SUNRISE_LIB_DIR", str(libdir))
    pool = f"h{uuid.uuid4().hex[:8]}"
    metrics_port = free_port()
    agent = LocalAgent(address=f"127.0.0.1:{free_port()}", token_file=tmp_path / "token", pool=pool, dram="16Mi",
                       extra=["--hbm", "8Mi", "--metrics-port", str(metrics_port)])
    try:
        agent.start()
        with KVPoolClient(endpoints=[agent.address], token=agent.token_file.read_text().strip(),
                          namespace="ns") as c:
            data = [bytes([i]) * (256 << 10) for i in range(4)]
            assert c.batch_put([f"d{i}" for i in range(4)], data, tier="hbm") == [1] * 4
            out = [bytearray(256 << 10) for _ in range(4)]
            # Same-node client: HBM blocks are not mappable, so these come back over the socket.
            assert c.batch_get_into([f"d{i}" for i in range(4)], out) == [256 << 10] * 4
            assert [bytes(o) for o in out] == data
            assert c.batch_get_into(["absent"], [bytearray(1)]) == [None]
        text = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics").text
        assert 'daybreak_store_hits_total{tier="hbm"} 4.0' in text
        assert "daybreak_store_misses_total 1.0" in text
        assert 'daybreak_store_capacity_bytes{tier="hbm"} 1.6777216e+07' in text  # --hbm on each of 2 devices
        assert 'daybreak_store_request_seconds_count{op="put"}' in text
    finally:
        agent.kill()
        cleanup_pool(pool)
