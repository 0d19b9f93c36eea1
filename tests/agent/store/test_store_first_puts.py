"""Item 4 of issue 10: a fresh agent backs its tier without slowing the first requests, and the split verified read."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from daybreak.agent.store.tiers import HEAD_BYTES, DramTier
from daybreak.client import KVPoolClient
from daybreak.pool import checksum
from daybreak.pool.shm import BACKING_WINDOW, SHM_DIR, Backing, ShmSegment
from daybreak.testing.store_agent import LocalAgent, cleanup_pool, free_port

MiB = 1 << 20


@pytest.fixture
def segment() -> Iterator[ShmSegment]:
    seg = ShmSegment.create(f"daybreak-test-backing-{uuid.uuid4().hex[:8]}", 9 * BACKING_WINDOW + 4096)
    yield seg
    seg.close()
    seg.unlink()


def test_backing_populates_only_the_windows_an_access_touches(segment: ShmSegment) -> None:
    backing = Backing(segment)
    assert backing.pending() == [(0, segment.size)]
    backing.ensure(BACKING_WINDOW + 10, BACKING_WINDOW)  # straddles windows 1 and 2
    assert backing.pending() == [(0, BACKING_WINDOW), (3 * BACKING_WINDOW, segment.size - 3 * BACKING_WINDOW)]
    backing.ensure(segment.size - 1, 1)  # the short last window
    assert backing.pending()[-1] == (3 * BACKING_WINDOW, 6 * BACKING_WINDOW)
    backing.ensure(0, segment.size)
    assert backing.pending() == []
    segment.buffer[:4] = b"same"
    backing.ensure(0, 4)  # populating never changes contents
    assert bytes(segment.buffer[:4]) == b"same"


def test_a_fresh_dram_tier_backs_its_head_before_serving_and_the_rest_in_the_background() -> None:
    tier = DramTier(prefix=f"daybreak-test-head-{uuid.uuid4().hex[:8]}", capacity=HEAD_BYTES + 64 * MiB,
                    segment_bytes=HEAD_BYTES // 2)
    try:
        tier.open()
        assert [b.pending() for b in tier.backing[:2]] == [[], []]  # the head: where the first blocks go
        assert tier.backing[2].pending() == [(0, 64 * MiB)]
        tier.prefault()
        assert all(not b.pending() for b in tier.backing)
    finally:
        tier.close(unlink=True)


def test_the_background_fill_waits_while_requests_are_served() -> None:
    tier = DramTier(prefix=f"daybreak-test-yield-{uuid.uuid4().hex[:8]}", capacity=HEAD_BYTES + 64 * MiB,
                    segment_bytes=HEAD_BYTES // 2)
    busy = threading.Event()
    busy.set()
    try:
        tier.open()
        before = tier.backing[2].pending()
        filler = threading.Thread(target=tier.prefault, kwargs={"busy": busy.is_set})
        filler.start()
        time.sleep(0.3)
        assert tier.backing[2].pending() == before  # nothing filled while "requests" arrive
        busy.clear()
        filler.join(timeout=60)
        assert not filler.is_alive() and all(not b.pending() for b in tier.backing)
    finally:
        busy.clear()
        tier.close(unlink=True)


@pytest.fixture
def agent(tmp_path: Path) -> Iterator[LocalAgent]:
    pool = f"t{uuid.uuid4().hex[:8]}"
    a = LocalAgent(address=f"127.0.0.1:{free_port()}", token_file=tmp_path / "token", pool=pool, dram="512Mi")
    yield a
    a.kill()
    cleanup_pool(pool)


@pytest.mark.parametrize("transport", ["auto", "tcp"])
def test_puts_right_after_start_are_stored_byte_exact_while_the_tier_fills(agent: LocalAgent, transport: str) -> None:
    agent.start()
    data = [np.random.default_rng(i).integers(0, 256, MiB, dtype=np.uint8) for i in range(48)]
    keys = [f"k{i}" for i in range(48)]
    token = agent.token_file.read_text().strip()
    with KVPoolClient(endpoints=[agent.address], token=token, namespace="ns", transport=transport) as c:
        for i in range(0, 48, 16):  # 48 MiB: beyond nothing, but written while the fill may still run
            assert c.batch_put(keys[i:i + 16], data[i:i + 16]) == [1] * 16
        out = [np.zeros(MiB, np.uint8) for _ in keys]
        assert c.batch_get_into(keys, out) == [MiB] * 48
        assert all(np.array_equal(a, b) for a, b in zip(out, data, strict=True))
    assert agent.wait_for("event=prefault_done", timeout_seconds=60)
    assert agent.wait_log("event=dram_head_backed"), agent.log[-2000:]


@pytest.mark.parametrize("path", ["fused", "split"])
def test_a_verified_same_node_batch_never_returns_a_corrupt_block(agent: LocalAgent, path: str,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    # "fused": one-pass copy + CRC (the extension); "split": copy then CRC, the batch over two threads.
    if path == "split":
        monkeypatch.setattr(checksum, "_fused", None)
    assert checksum.fused() == (path == "fused"), "the _copycrc extension did not build (pip install -e .)"
    agent.start()
    token = agent.token_file.read_text().strip()
    data = [np.full(MiB, i + 1, np.uint8) for i in range(8)]  # 8 MiB: the split path (>= 4 MiB)
    keys = [f"b{i}" for i in range(8)]
    with KVPoolClient(endpoints=[agent.address], token=token, namespace="ns") as c:
        assert c.batch_put(keys, data) == [1] * 8
        segment = next(SHM_DIR.glob(f"daybreak-{agent.pool}-*-dram-0"))
        with segment.open("r+b") as f:  # flip a byte of blocks 3 and 6 behind the agent's back
            for victim in (3, 6):
                raw = segment.read_bytes()[:64 * MiB]
                f.seek(raw.find(bytes([victim + 1]) * MiB) + 12345)
                f.write(b"\x00")
                f.flush()
        out = [np.zeros(MiB, np.uint8) for _ in keys]
        sizes = c.batch_get_into(keys, out)
        assert sizes == [MiB if i not in (3, 6) else None for i in range(8)]
        assert all(np.array_equal(out[i], data[i]) for i in range(8) if i not in (3, 6))
    assert agent.wait_log("event=block_corrupt tier=dram", count=2) and agent.log.count("event=block_corrupt tier=dram") == 2, agent.log[-2000:]
