"""FLUSH_NAMESPACE against real agent processes: every tier and every agent, other namespaces kept, scopes."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from daybreak.client import KVPoolAuthorizationError, KVPoolClient
from daybreak.pool import protocol as p
from daybreak.pool.connection import Connection, RemoteError
from daybreak.pool.credentials import agent_credential, namespace_credential
from daybreak.testing.store_agent import LocalAgent, cleanup_pool, free_port

MiB = 1 << 20


@pytest.fixture
def agents(tmp_path: Path) -> Iterator[tuple[list[LocalAgent], str]]:
    name = f"f{uuid.uuid4().hex[:8]}"
    token_file = tmp_path / "token"
    addresses = [f"127.0.0.1:{free_port()}" for _ in range(2)]
    started: list[LocalAgent] = []
    try:
        for i, address in enumerate(addresses):
            # The first agent has a small DRAM tier over an SSD tier, so its blocks span two tiers.
            extra = ["--ssd-path", str(tmp_path / "ssd"), "--ssd", "64Mi", "--eviction", "lru"] if i == 0 else []
            agent = LocalAgent(address=address, token_file=token_file, pool=name, dram="8Mi" if i == 0 else "64Mi",
                               peers=[a for a in addresses if a != address], replicas=1, extra=extra)
            started.append(agent)
            agent.start()
        yield started, token_file.read_text().strip()
    finally:
        for agent in started:
            agent.kill()
        cleanup_pool(name)


def data(n: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, MiB, dtype=np.uint8) for _ in range(n)]


def stats(agent: LocalAgent, token: str) -> dict[str, str]:
    conn = Connection(agent.address, token=token.encode())
    try:
        return conn.stats()
    finally:
        conn.close()


def held(agent: LocalAgent, token: str) -> int:
    return int(stats(agent, token)["blocks"])


def test_flush_deletes_one_namespace_from_every_agent_and_tier(agents: tuple[list[LocalAgent], str]) -> None:
    pool, token = agents
    old_keys = [f"old{i}" for i in range(40)]
    old = data(40, seed=1)
    new = data(8, seed=2)
    endpoints = [pool[0].address]
    with KVPoolClient(endpoints, token=token, namespace="model-r1", transport="tcp") as c_old, \
            KVPoolClient(endpoints, token=token, namespace="model-r2", transport="tcp") as c_new:
        for i in range(0, 40, 4):
            assert c_old.batch_put(old_keys[i:i + 4], old[i:i + 4]) == [1] * 4
        assert c_new.batch_put([f"new{i}" for i in range(8)], new) == [1] * 8
        # Same suffixes in a namespace whose name shares a prefix with the flushed one: must survive.
        with KVPoolClient(endpoints, token=token, namespace="model-r1x", transport="tcp") as c_sibling:
            assert c_sibling.batch_put(["old0"], [old[0]]) == [1]
            stored_on = {a.address: held(a, token) for a in pool}
            assert all(n > 0 for n in stored_on.values()), stored_on  # both agents hold blocks
            first = stats(pool[0], token)
            assert int(first["blocks_ssd"]) > 0 and int(first["blocks_dram"]) > 0, first  # and both tiers do

            freed = c_new.flush_namespace("model-r1")  # the pool secret may flush any namespace
            assert freed == 40 * MiB
            assert c_old.batch_exists(old_keys) == [False] * 40
            out = [np.zeros(MiB, np.uint8) for _ in old_keys]
            assert c_old.batch_get_into(old_keys, out) == [None] * 40
            assert c_new.batch_exists([f"new{i}" for i in range(8)]) == [True] * 8
            got = [np.zeros(MiB, np.uint8) for _ in range(8)]
            assert c_new.batch_get_into([f"new{i}" for i in range(8)], got) == [MiB] * 8
            assert all(np.array_equal(g, n) for g, n in zip(got, new, strict=True))
            assert c_sibling.batch_exists(["old0"]) == [True]
            # Nothing is left to free: a second (retried) flush frees nothing and fails nothing.
            assert c_new.flush_namespace("model-r1") == 0
    assert sum(held(a, token) for a in pool) == 8 + 1
    assert int(stats(pool[0], token)["ssd_used"]) <= 9 * MiB  # the SSD files of model-r1 are gone too
    assert any("event=namespace_flushed" in a.log for a in pool)


def test_flush_scopes_admin_any_namespace_own_agent_none(agents: tuple[list[LocalAgent], str]) -> None:
    pool, token = agents
    secret = token.encode()
    endpoints = [pool[0].address]
    cred_a = namespace_credential(secret, "team-a")
    with KVPoolClient(endpoints, token=token, namespace="team-b", transport="tcp") as b:
        assert b.batch_put(["k"], [b"b-data"]) == [1]
    with KVPoolClient(endpoints, token=cred_a, namespace="team-a", transport="tcp") as a:
        assert a.batch_put(["k"], [b"a-data"]) == [1]
        # team-a's credential may not flush team-b: refused, and team-b's block is still there.
        with pytest.raises(KVPoolAuthorizationError, match="not authorized"):
            a.flush_namespace("team-b")
    # The connection that asked is closed by the agent; a new client with the same credential still works
    # and may flush its own namespace.
    with KVPoolClient(endpoints, token=cred_a, namespace="team-a", transport="tcp") as a:
        assert a.flush_namespace("team-a") == len(b"a-data")
        assert a.batch_exists(["k"]) == [False]
    # The agent credential (what agents present to each other) flushes nothing.
    conn = Connection(pool[0].address, token=agent_credential(secret).encode())
    try:
        with pytest.raises(RemoteError, match="not authorized"):
            conn.flush_namespace("team-b")
    finally:
        conn.close()
    with KVPoolClient(endpoints, token=token, namespace="team-b", transport="tcp") as b:
        assert b.batch_exists(["k"]) == [True]
    assert any("event=request_refused" in agent.log for agent in pool)


def test_flush_checks_its_input(agents: tuple[list[LocalAgent], str]) -> None:
    pool, token = agents
    with KVPoolClient([pool[0].address], token=token, namespace="ns", transport="tcp") as c:
        with pytest.raises(ValueError, match="must match"):
            c.flush_namespace("bad/namespace")
        with pytest.raises(ValueError, match="must match"):
            c.flush_namespace("")
    # A hand-made frame with a namespace the client would refuse closes that connection only.
    conn = Connection(pool[0].address, token=token.encode())
    try:
        with pytest.raises((ConnectionError, p.ProtocolError, OSError)):
            conn._call(p.Op.FLUSH_NAMESPACE, bytes(p.Writer().text("a/b").buf))
    finally:
        conn.close()
    assert held(pool[0], token) == 0  # the agent still answers
