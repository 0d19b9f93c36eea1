"""Store internals in one process: extent allocation, eviction order, placement, the block index and journal."""

from __future__ import annotations

import itertools
import os
import random
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from daybreak.agent.store.alloc import ALIGN, Arena
from daybreak.agent.store.engine import BlockStore, Reservation, StoreConfig
from daybreak.agent.store.eviction import LRU, S3FIFO, make_policy
from daybreak.pool import capability
from daybreak.pool import protocol as p
from daybreak.pool.checksum import _slow_crc32c, crc32c
from daybreak.pool.placement import rank
from daybreak.testing.store_agent import cleanup_pool


def test_crc32c_matches_reference_and_fallback() -> None:
    assert crc32c(b"123456789") == 0xE3069283  # the standard check value
    data = bytes(random.Random(1).randbytes(5000))
    assert crc32c(data) == _slow_crc32c(data)


def test_arena_alloc_free_coalesces_back_to_one_extent() -> None:
    arena = Arena(64 * ALIGN)
    rng = random.Random(2)
    held: list[tuple[int, int]] = []
    for _ in range(2000):
        if held and rng.random() < 0.45:
            off, size = held.pop(rng.randrange(len(held)))
            arena.free(off, size)
        else:
            size = rng.randint(1, 6 * ALIGN)
            off = arena.alloc(size)
            if off is not None:
                held.append((off, size))
    # No two live extents overlap.
    spans = sorted((off, off + -(-size // ALIGN) * ALIGN) for off, size in held)
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans))
    for off, size in held:
        arena.free(off, size)
    assert arena.free_bytes == arena.size and arena.largest_free() == arena.size


def test_arena_reserve_and_double_free() -> None:
    arena = Arena(16 * ALIGN)
    assert arena.reserve(4 * ALIGN, 2 * ALIGN)
    assert not arena.reserve(5 * ALIGN, ALIGN)  # overlaps
    assert not arena.reserve(3, ALIGN)  # unaligned
    assert arena.free_bytes == 14 * ALIGN
    arena.free(4 * ALIGN, 2 * ALIGN)
    with pytest.raises(ValueError, match="double free"):
        arena.free(4 * ALIGN, 2 * ALIGN)
    with pytest.raises(ValueError, match="multiple"):
        Arena(1000)


def test_lru_order_and_skip() -> None:
    lru = LRU()
    for k in "abcd":
        lru.insert(k, 1)
    lru.touch("a")
    assert lru.victim(lambda k: True) == "b"
    assert lru.victim(lambda k: k not in "bc") == "d"


def test_s3fifo_keeps_reused_keys_through_a_scan() -> None:
    s3 = S3FIFO()
    hot = [f"hot{i}" for i in range(10)]
    for k in hot:
        s3.insert(k, 1)
        s3.touch(k)  # read while in the small queue: promoted when it reaches the head
    cache = set(hot)
    capacity = 40
    for i in range(400):  # a one-pass scan of 400 blocks through a 40-block cache
        key = f"scan{i}"
        s3.insert(key, 1)
        cache.add(key)
        for k in hot[: i % 3]:
            s3.touch(k)
        while len(cache) > capacity:
            victim = s3.victim(lambda k: True)
            assert victim is not None
            s3.remove(victim)
            cache.discard(victim)
    assert set(hot) <= cache  # LRU would have kept only what the scan touched last

    lru = LRU()
    cache = set()
    for k in hot:
        lru.insert(k, 1)
        cache.add(k)
    for i in range(400):
        lru.insert(f"scan{i}", 1)
        cache.add(f"scan{i}")
        while len(cache) > capacity:
            victim = lru.victim(lambda k: True)
            assert victim is not None
            lru.remove(victim)
            cache.discard(victim)
    assert not set(hot) & cache


def test_s3fifo_refuses_when_nothing_is_evictable() -> None:
    s3 = make_policy("s3fifo")
    for k in "abc":
        s3.insert(k, 1)
    assert s3.victim(lambda k: False) is None
    with pytest.raises(ValueError, match="eviction policy"):
        make_policy("fifo")


def test_rendezvous_moves_only_the_leavers_keys() -> None:
    agents = [f"10.0.0.{i}:7480" for i in range(5)]
    keys = [f"k{i}" for i in range(3000)]
    before = {k: rank(k, agents)[0] for k in keys}
    after = {k: rank(k, agents[:4])[0] for k in keys}
    moved = [k for k in keys if before[k] != after[k]]
    assert all(before[k] == agents[4] for k in moved)
    share = sum(1 for k in keys if before[k] == agents[4]) / len(keys)
    assert 0.15 < share < 0.25  # about 1/5 of the keys live on each agent


@pytest.fixture
def store(tmp_path: Path) -> Iterator[BlockStore]:
    pool = f"u{uuid.uuid4().hex[:8]}"
    s = BlockStore(StoreConfig(prefix=f"daybreak-{pool}-x", dram_bytes=8 << 20, policy="lru",
                               high_watermark=0.75, low_watermark=0.5, lease_seconds=60))
    s.open()
    yield s
    s.close(unlink=True)
    cleanup_pool(pool)


def put(store: BlockStore, key: str, data: bytes) -> None:
    res = store.reserve(key, len(data), crc32c(data))
    assert isinstance(res, Reservation), res
    store.target(res)[:] = data
    store.commit([res])


def test_engine_uncommitted_blocks_are_invisible_and_busy(store: BlockStore) -> None:
    res = store.reserve("k", 4096, 0)
    assert isinstance(res, Reservation)
    assert store.exists(["k"]) == [None]
    assert store.reserve("k", 4096, 0) == p.Status.BUSY
    store.commit([res], ok=False)
    assert store.exists(["k"]) == [None] and store.dram.used == 0


def test_engine_everything_leased_means_full(store: BlockStore) -> None:
    size = 1 << 20
    for i in range(6):
        put(store, f"b{i}", bytes([i]) * size)
    held = store.acquire([f"b{i}" for i in range(6)])
    assert store.reserve("new", 3 * size, 0) == p.Status.FULL
    store.release(held)
    assert isinstance(store.reserve("new", 3 * size, 0), Reservation)


def test_engine_journal_replay_survives_reopen(store: BlockStore) -> None:
    put(store, "keep", b"k" * 10000)
    put(store, "gone", b"g" * 10000)
    assert store.remove(["gone", "never"]) == [p.Status.OK, p.Status.MISS]
    config = store.config
    store.close()
    again = BlockStore(StoreConfig(prefix=config.prefix, dram_bytes=config.dram_bytes))
    again.open()
    try:
        assert [b is not None for b in again.exists(["keep", "gone"])] == [True, False]
        (block,) = again.acquire(["keep"])
        assert block is not None and bytes(again.view(block)) == b"k" * 10000
        again.release([block])
    finally:
        again.close()


def test_engine_changed_size_starts_empty(store: BlockStore) -> None:
    put(store, "keep", b"k" * 10000)
    prefix = store.config.prefix
    store.close()
    bigger = BlockStore(StoreConfig(prefix=prefix, dram_bytes=16 << 20))
    bigger.open()
    try:
        assert bigger.exists(["keep"]) == [None]
    finally:
        bigger.close()


def test_engine_soft_pins_yield_only_when_nothing_else_can(store: BlockStore) -> None:
    size = 1 << 20
    res = store.reserve("pinned", size, 0, pin_seconds=600)
    assert isinstance(res, Reservation)
    store.commit([res])
    for i in range(5):
        put(store, f"p{i}", b"x" * size)
    # The watermark pass skips the pinned block even though it is the oldest.
    assert store.exists(["pinned"])[0] is not None
    # A block that needs the whole tier may take pinned space (soft pin).
    assert isinstance(store.reserve("huge", 8 << 20, 0), Reservation)
    assert store.exists(["pinned"])[0] is None


def test_engine_rejects_bad_watermarks() -> None:
    with pytest.raises(ValueError, match="low_watermark"):
        BlockStore(StoreConfig(prefix="daybreak-x-y", dram_bytes=1 << 20, high_watermark=0.5, low_watermark=0.6))


@pytest.mark.parametrize(("args", "message"), [
    (["--dram", "lots"], "--dram"),
    (["--ssd", "1Gi"], "--ssd: needs --ssd-path"),
    (["--high-watermark", "1.5"], "high_watermark"),
])
def test_agent_cli_rejects_bad_flags_naming_them(tmp_path: Path, args: list[str], message: str) -> None:
    out = subprocess.run([sys.executable, "-m", "daybreak", "agent", "--standalone", "--token-file",
                          str(tmp_path / "t"), *args], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONSAFEPATH": "1"}, cwd="/")
    assert out.returncode != 0
    assert message in out.stderr


def test_agent_cli_needs_a_token_file_standalone() -> None:
    out = subprocess.run([sys.executable, "-m", "daybreak", "agent", "--standalone"], capture_output=True,
                         text=True, timeout=60, env={**os.environ, "PYTHONSAFEPATH": "1"}, cwd="/")
    assert out.returncode == 2 and "--token-file: required with --standalone" in out.stderr


def test_a_capability_covers_one_range_of_one_segment_for_one_scope_until_its_grant_ends(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """pool/capability.py: every field is bound by the MAC; a second agent process cannot verify the first's."""
    authority = capability.Authority()
    live = {7}
    now = time.monotonic()
    raw = authority.mint(segment_id="e1/dram-0", offset=4096, length=8192, rights=capability.READ, grant=7,
                         expires=now + 10, claim="ns:team-a")
    assert len(raw) == capability.SIZE

    def check(cap: bytes | None = raw, **kw: object) -> str:
        args: dict[str, object] = {"segment_id": "e1/dram-0", "offset": 4096, "length": 8192,
                                   "right": capability.READ, "claim": "ns:team-a",
                                   "live": lambda grant, right: grant in live, **kw}
        return authority.check(cap, **args)  # type: ignore[arg-type]

    assert check() == "" and check(offset=8192, length=4096) == ""
    assert check(claim="admin") == ""  # the pool secret may spend anyone's capability
    refused = {
        "no capability": check(None),
        "another segment": check(segment_id="e1/dram-1"),
        "outside the capability": check(offset=0),
        "grants READ only": check(right=capability.WRITE),
        "another scope": check(claim="ns:team-b"),
        "MAC does not verify": capability.Authority().check(
            raw, segment_id="e1/dram-0", offset=4096, length=8192, right=capability.READ, claim="ns:team-a",
            live=lambda grant, right: True),
        "not 68 bytes": check(raw[:-1]),
    }
    for reason, got in refused.items():
        assert reason in got, (reason, got)
    live.clear()
    assert "revoked" in check()
    live.add(7)
    monkeypatch.setattr(capability.time, "monotonic", lambda: now + 11)
    assert "expired" in check()


def test_blocks_reply_carries_one_capability_per_block_or_none() -> None:
    infos = [p.BlockInfo(p.Status.OK, 10, 1, "e1/dram-0", 4096), p.BlockInfo(p.Status.MISS)]
    reply = p.BlocksReply.decode(p.BlocksReply(infos, 9, [b"c" * 68, b""]).encode())
    assert reply.capabilities == [b"c" * 68, b""] and reply.capability(0) == b"c" * 68 and reply.lease_id == 9
    assert p.BlocksReply.decode(p.BlocksReply(infos).encode()).capability(1) == b""
    raw = bytearray(p.BlocksReply(infos, 9, [b"c" * 68, b""]).encode())
    struct_at = raw.rfind((2).to_bytes(4, "little"))  # the capability count: one for two blocks is malformed
    raw[struct_at:struct_at + 4] = (1).to_bytes(4, "little")
    with pytest.raises(p.ProtocolError):
        p.BlocksReply.decode(raw)
