"""eviction.policy applies to every tier: the SSD tier used to be LRU whatever the pool said."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest

from daybreak.agent.store.engine import BlockStore, StoreConfig
from daybreak.agent.store.eviction import make_policy
from daybreak.agent.store.tiers import SsdOwner, ssd_directory
from daybreak.testing.store_agent import cleanup_pool


@pytest.mark.parametrize("policy", ["lru", "s3fifo"])
def test_the_ssd_tier_evicts_by_the_pools_policy(tmp_path: Path, policy: str) -> None:
    pool = f"p{uuid.uuid4().hex[:8]}"
    owner = SsdOwner.for_pool(secret=os.urandom(32).hex().encode(), namespace="team", name=pool, uid="u")
    store = BlockStore(StoreConfig(prefix=f"daybreak-{pool}-x", dram_bytes=1 << 20, ssd_bytes=8 << 20,
                                   ssd_owner=owner, policy=policy,
                                   ssd_path=str(ssd_directory(root=tmp_path, owner=owner, agent="10.0.0.1:7400"))))
    store.open()
    try:
        expected = type(make_policy(policy))
        assert {tier: type(p) for tier, p in store.policies.items()} == {t: expected for t in ("dram", "ssd", "hbm")}
    finally:
        store.close(unlink=True)
        cleanup_pool(pool)
