"""Issue 22 finding 3, a fair share per kvNamespace: one authenticated namespace must not lock the others out.

The unit tests check the accounting (leases, parked reservations, pins, per-credential connections) and
the eviction choice in one process; the attack tests run real standalone agents (``testing/store_agent.py``)
and real sockets: a victim namespace writes its working set (20 blocks of 1 MiB), an attacker namespace
keeps leases, reservations, pins or hundreds of idle connections, and the victim must keep at least half of
its blocks (and connect) while the attacker gets an error naming the quota. Each prints what it measured
(``-s`` shows it).
"""

from __future__ import annotations

import contextlib
import socket
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from daybreak.agent.settings import AgentSettings
from daybreak.agent.store.engine import (
    BlockStore,
    QuotaExceeded,
    Quotas,
    Reservation,
    StoreConfig,
    namespace_of,
)
from daybreak.agent.store.eviction import FairShare
from daybreak.agent.store.metrics import NAMESPACE_SERIES, OTHER_NAMESPACES
from daybreak.client import KVPoolClient, KVPoolError, KVPoolQuotaError
from daybreak.pool import protocol as p
from daybreak.pool.admission import Admission, Caps
from daybreak.pool.checksum import crc32c
from daybreak.pool.connection import Connection, RemoteError
from daybreak.pool.credentials import namespace_credential
from daybreak.testing.store_agent import LocalAgent, cleanup_pool, free_port

MiB = 1 << 20
WORKING_SET = 20  # the victim's blocks, 1 MiB each


# -- units: the accounting and the eviction choice ------------------------------------------------------------

@pytest.fixture
def store() -> Iterator[BlockStore]:
    pool = f"f{uuid.uuid4().hex[:8]}"
    s = BlockStore(StoreConfig(prefix=f"daybreak-{pool}-x", dram_bytes=16 * MiB, policy="lru",
                               high_watermark=0.9, low_watermark=0.8, lease_seconds=60,
                               quotas=Quotas(held_fraction=0.5, pinned_fraction=0.25, max_pin_seconds=600)))
    s.open()
    yield s
    s.close(unlink=True)
    cleanup_pool(pool)


def put(store: BlockStore, key: str, size: int = MiB, *, pin_seconds: int = 0) -> None:
    data = bytes([len(key) % 256]) * size
    res = store.reserve(key, size, crc32c(data), pin_seconds=pin_seconds)
    assert isinstance(res, Reservation), res
    store.target(res)[:] = data
    store.commit([res])


def present(store: BlockStore, keys: list[str]) -> int:
    return sum(b is not None for b in store.exists(keys))


def test_namespace_of_a_key_is_what_precedes_its_first_slash() -> None:
    assert namespace_of("team-a/abc/def") == "team-a"
    assert namespace_of("plain") == ""
    assert namespace_of("/x") == ""


def test_fair_share_picks_the_namespace_furthest_over_its_share() -> None:
    share = FairShare()
    for i in range(6):
        share.insert("a", f"a/{i}", 10)
    for i in range(3):
        share.insert("b", f"b/{i}", 10)
    share.insert("c", "c/0", 10)
    # 100 bytes, 3 namespaces: a share is 33; a holds 60 (27 over), b 30 and c 10 are under.
    assert share.over_share(100) == [("a", 26)]
    assert share.victim(capacity=100, evictable=lambda k: True) == "a/0"
    # Held blocks of the namespace are passed over, oldest evictable first.
    assert share.victim(capacity=100, evictable=lambda k: k not in ("a/0", "a/1")) == "a/2"
    # Nothing evictable in the namespaces over their share: the caller falls back to the policy.
    assert share.victim(capacity=100, evictable=lambda k: not k.startswith("a/")) is None
    # One namespace alone owns the whole tier.
    alone = FairShare()
    alone.insert("a", "a/0", 90)
    assert alone.over_share(100) == [] and alone.victim(capacity=100, evictable=lambda k: True) is None
    share.remove("c", "c/0")
    assert "c" not in share.bytes


def test_eviction_takes_from_the_namespace_over_its_share_before_the_older_blocks_of_others(
        store: BlockStore) -> None:
    victim = [f"victim/{i}" for i in range(4)]
    for key in victim:  # the oldest blocks of the tier: plain LRU would take these first
        put(store, key)
    for i in range(30):  # another namespace writes on and on
        put(store, f"evil/{i}")
    assert present(store, victim) == 4
    assert store.usage()["dram"] <= 16 * MiB * 0.9
    evil = store.shares["dram"].bytes["evil"]
    assert evil > 8 * MiB  # the writer is over its share (half the tier) and pays for its own writes
    # Without a second namespace the policy alone decides (LRU: oldest first).
    assert store.metrics.fair_share_evictions.labels(tier="dram")._value.get() > 0


def test_leases_and_parked_reservations_are_counted_and_given_back(store: BlockStore) -> None:
    for i in range(4):
        put(store, f"a/{i}")
    blocks = store.acquire([f"a/{i}" for i in range(4)])
    lease = store.lease(blocks)
    assert store.held[("dram", "a")] == 4 * MiB
    res = store.reserve("a/new", MiB, 0)
    assert isinstance(res, Reservation)
    rid = store.park([res, None])
    assert store.held[("dram", "a")] == 5 * MiB
    # Half the 16 MiB tier is 8 MiB: 5 held, 3 more fit, 4 do not.
    store.admit(reserve=[(f"a/r{i}", MiB) for i in range(3)])
    with pytest.raises(QuotaExceeded, match="quota exceeded: namespace 'a' would have 9437184 bytes") as err:
        store.admit(reserve=[(f"a/r{i}", MiB) for i in range(4)])
    assert err.value.quota == "held"
    with pytest.raises(QuotaExceeded, match="held quota"):
        store.admit(lease=[f"a/{i}" for i in range(4)])  # a renewal on top of the lease it renews
    store.admit(reserve=[(f"b/{i}", 8 * MiB // 8) for i in range(8)])  # another namespace has its own quota
    parked = store.unpark(rid)
    assert parked is not None
    store.commit([r for r in parked if r is not None], ok=False)
    store.end_lease(lease)
    assert ("dram", "a") not in store.held
    # An expired lease and an expired reservation give their bytes back too.
    store.lease(store.acquire(["a/0"]))
    res = store.reserve("a/late", MiB, 0)
    assert isinstance(res, Reservation)
    store.park([res])
    for lease_entry in store.leases.values():
        lease_entry.expires = 0
    for parked_entry in store.reservations.values():
        parked_entry.expires = 0
    store.expire()
    assert not store.held and not store.writing


def test_pins_are_bounded_in_time_and_in_share(store: BlockStore) -> None:
    with pytest.raises(QuotaExceeded, match="pin_seconds=4294967295 is longer than this pool's maxPinSeconds") as err:
        store.admit(pin=[("a/x", MiB)], pin_seconds=2**32 - 1)
    assert err.value.quota == "pin_seconds"
    for i in range(4):  # a quarter of 16 MiB
        store.admit(pin=[(f"a/{i}", MiB)], pin_seconds=600)
        put(store, f"a/{i}", pin_seconds=600)
    assert store.pinned[("dram", "a")] == 4 * MiB
    with pytest.raises(QuotaExceeded, match="pinned quota") as err:
        store.admit(pin=[("a/more", MiB)], pin_seconds=600)
    assert err.value.quota == "pinned"
    store.admit(pin=[("b/0", MiB)], pin_seconds=600)
    # A removed block's pin ends with it; the others end when their time is up.
    assert store.remove(["a/0"]) == [p.Status.OK]
    assert store.pinned[("dram", "a")] == 3 * MiB
    store._expire_pins(time.monotonic() + 601)
    assert not store.pinned


def test_namespace_metrics_keep_a_bounded_label_set(store: BlockStore) -> None:
    for i in range(NAMESPACE_SERIES + 4):
        put(store, f"ns{i:02d}/k", 64 << 10)
    store.expire()  # the maintenance tick publishes the namespace usage
    text = "\n".join(
        f"{s.labels['namespace']}" for metric in store.metrics.namespace_bytes.collect() for s in metric.samples
        if s.labels["kind"] == "stored")
    names = set(text.split())
    assert len(names) == NAMESPACE_SERIES + 1 and OTHER_NAMESPACES in names
    usage = store.namespace_usage()
    assert usage[("dram", "ns00")] == (64 << 10, 0, 0)


def test_connections_are_capped_per_credential_and_freed_on_close() -> None:
    admission = Admission(Caps(max_connections_per_credential=2), label="server=test")
    pairs = [socket.socketpair() for _ in range(4)]
    try:
        conns = [a for a, _ in pairs]
        for conn in conns:
            assert admission.admit(conn, "127.0.0.1")
        for conn in conns:
            admission.authenticated(conn)
        assert admission.admit_credential(conns[0], "ns:a")
        assert admission.admit_credential(conns[1], "ns:a")
        assert not admission.admit_credential(conns[2], "ns:a")  # the third of one credential
        assert admission.admit_credential(conns[3], "ns:b")
        admission.release("127.0.0.1", conns[0])
        fresh, other = socket.socketpair()
        pairs.append((fresh, other))
        assert admission.admit(fresh, "127.0.0.1") and admission.admit_credential(fresh, "ns:a")
    finally:
        for a, b in pairs:
            a.close()
            b.close()


def test_kvpool_quotas_reach_the_agent_config() -> None:
    from daybreak.api.kvpool import KVPool
    from daybreak.operator.pool import agent_settings

    pool = KVPool.model_validate({
        "metadata": {"name": "p", "namespace": "ns"},
        "spec": {"tiers": {"dram": {"bytesPerNode": "1Gi"}},
                 "quotas": {"heldFraction": 0.3, "pinnedFraction": 0.1, "maxPinSeconds": 60,
                            "maxConnectionsPerCredential": 32}}})
    rendered = AgentSettings.model_validate(agent_settings(pool))
    assert (rendered.namespace_held_fraction, rendered.namespace_pinned_fraction, rendered.max_pin_seconds,
            rendered.max_connections_per_credential) == (0.3, 0.1, 60, 32)
    defaults = AgentSettings()
    quotas = Quotas()
    assert (defaults.namespace_held_fraction, defaults.namespace_pinned_fraction, defaults.max_pin_seconds) == (
        quotas.held_fraction, quotas.pinned_fraction, quotas.max_pin_seconds)


# -- the four attacks, against real agent processes ------------------------------------------------------------


def start(pool: dict[str, Any], *, dram: str = "64Mi", extra: list[str] | None = None) -> LocalAgent:
    agent = LocalAgent(address=f"127.0.0.1:{free_port()}", token_file=pool["token_file"], pool=pool["name"],
                       dram=dram, extra=extra or [])
    pool["agents"].append(agent)
    return agent.start()


def credential(pool: dict[str, Any], namespace: str) -> str:
    return namespace_credential(Path(pool["token_file"]).read_text().strip().encode(), namespace)


def victim_writes_its_working_set(agent: LocalAgent, pool: dict[str, Any]) -> tuple[KVPoolClient, list[str]]:
    victim = KVPoolClient(endpoints=[agent.address], token=credential(pool, "victim"), namespace="victim",
                          transport="tcp")
    keys = [f"v{i}" for i in range(WORKING_SET)]
    assert victim.batch_put(keys, [bytes([i]) * MiB for i in range(WORKING_SET)]) == [1] * WORKING_SET
    return victim, keys


def kept(victim: KVPoolClient, keys: list[str]) -> int:
    return sum(victim.batch_exists(keys))


def attacker_put(conn: Connection, keys: list[str], *, pin_seconds: int = 0) -> list[p.Status]:
    data = b"e" * MiB
    infos = conn.put(keys, [memoryview(data)] * len(keys), [crc32c(data)] * len(keys), pin_seconds=pin_seconds)
    return [i.status for i in infos]


def namespace_metrics(metrics_port: int) -> dict[tuple[str, ...], float]:
    """The agent's per-namespace gauges and quota refusals, from its /metrics."""
    text = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).text
    out: dict[tuple[str, ...], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "daybreak_store_namespace_bytes":
                out[(sample.labels["namespace"], sample.labels["kind"])] = sample.value
            elif sample.name == "daybreak_store_quota_refusals_total":
                out[("refused", sample.labels["quota"])] = sample.value
    return out


def test_kept_renewed_leases_of_one_namespace_leave_the_victim_its_working_set(pool: dict[str, Any]) -> None:
    metrics_port = free_port()
    agent = start(pool, extra=["--metrics-port", str(metrics_port)])
    victim, keys = victim_writes_its_working_set(agent, pool)
    evil = credential(pool, "evil").encode()
    conns = [Connection(agent.address, token=evil) for _ in range(4)]
    leased = refused = 0
    leases: list[tuple[Connection, int, list[str]]] = []
    errors: list[str] = []
    # Write 4 blocks at a time and lease them at once, round after round: without a quota every block of
    # the attacker stays leased, so only the victim's can be evicted for the next write.
    for step in range(15):
        batch = [f"evil/{step}-{i}" for i in range(4)]
        attacker_put(conns[step % 4], batch)
        try:
            reply = conns[step % 4].locate(batch)
        except RemoteError as exc:
            refused += 1
            errors.append(str(exc))
            continue
        leased += sum(i.status == p.Status.OK for i in reply.blocks)
        leases.append((conns[step % 4], reply.lease_id, batch))
    # Renew every lease before it ends (a new lease first, then the old one released): refused past the quota.
    renewed = 0
    for conn, lease_id, batch in leases:
        try:
            conn.locate(batch)
            renewed += 1
        except RemoteError as exc:
            refused += 1
            errors.append(str(exc))
        conn.release(lease_id)
    # The engine op (XLOCATE, agent/store/datapath.py) is held to the same quota.
    with contextlib.suppress(RemoteError):
        for conn, _, batch in leases:
            conn.xlocate(batch)
    try:
        conns[0].xlocate([f"evil/{step}-{i}" for step in range(8) for i in range(4)][:40])
        xlocate_refused = False
    except RemoteError as exc:
        xlocate_refused = "quota exceeded" in str(exc)
    held = kept(victim, keys)
    print(f"kept-renewed leases: victim holds {held}/{WORKING_SET} blocks; attacker leased {leased} MiB, "
          f"{refused} lease requests refused, {renewed} renewals admitted; XLOCATE refused={xlocate_refused}; "
          f"first error: {errors[:1]}")
    assert held >= WORKING_SET // 2
    assert refused and all("quota exceeded" in e and "held quota" in e and "'evil'" in e for e in errors)
    assert xlocate_refused
    # The usage per namespace is on /metrics (published every maintenance tick).
    deadline = time.monotonic() + 10
    seen = namespace_metrics(metrics_port)
    while seen.get(("evil", "held"), 0) == 0 and time.monotonic() < deadline:
        time.sleep(0.2)
        seen = namespace_metrics(metrics_port)
    print(f"metrics: evil held={seen.get(('evil', 'held'))} stored={seen.get(('evil', 'stored'))}, victim "
          f"stored={seen.get(('victim', 'stored'))}, refusals held={seen.get(('refused', 'held'))}")
    assert 0 < seen[("evil", "held")] <= 32 * MiB
    assert seen[("victim", "stored")] >= WORKING_SET // 2 * MiB
    assert seen[("refused", "held")] >= refused
    for conn in conns:
        conn.close()
    victim.close()


def test_reservations_never_committed_leave_the_victim_its_working_set(pool: dict[str, Any]) -> None:
    agent = start(pool)
    victim, keys = victim_writes_its_working_set(agent, pool)
    evil = credential(pool, "evil").encode()
    conns = [Connection(agent.address, token=evil) for _ in range(4)]
    reserved = 0
    errors: list[str] = []
    for step in range(16):  # 4 MiB per ALLOC, never committed: 64 MiB asked for in all
        batch = [f"evil/{step}-{i}" for i in range(4)]
        try:
            reply = conns[step % 4].alloc(batch, [MiB] * 4, [0] * 4)
            reserved += sum(i.status == p.Status.OK for i in reply.blocks)
        except RemoteError as exc:
            errors.append(str(exc))
    try:  # the engine op (XALLOC) too
        conns[0].xalloc([f"evil/x{i}" for i in range(4)], [MiB] * 4, [0] * 4)
        xalloc_refused = False
    except RemoteError as exc:
        xalloc_refused = "quota exceeded" in str(exc)
    held = kept(victim, keys)
    # The victim can still write while the attacker's reservations stand.
    more = victim.batch_put(["after"], [b"a" * MiB])
    print(f"never-committed reservations: victim holds {held}/{WORKING_SET} blocks, new write stored={more}; "
          f"attacker reserved {reserved} MiB, {len(errors)} ALLOCs refused; XALLOC refused={xalloc_refused}; "
          f"first error: {errors[:1]}")
    assert held >= WORKING_SET // 2 and more == [1]
    assert errors and all("quota exceeded" in e and "held quota" in e for e in errors)
    assert xalloc_refused
    assert reserved <= 32
    for conn in conns:
        conn.close()
    victim.close()


def test_long_pins_leave_the_victim_its_working_set(pool: dict[str, Any]) -> None:
    agent = start(pool)
    victim, keys = victim_writes_its_working_set(agent, pool)
    conn = Connection(agent.address, token=credential(pool, "evil").encode())
    with pytest.raises(RemoteError, match="quota exceeded: pin_seconds=4294967295 is longer than this pool's "
                                          "maxPinSeconds") as forever:
        attacker_put(conn, ["evil/forever"], pin_seconds=2**32 - 1)
    pinned = 0
    errors: list[str] = []
    for step in range(12):  # as much as it may, pinned for the longest pin allowed
        try:
            pinned += attacker_put(conn, [f"evil/p{step}-{i}" for i in range(2)], pin_seconds=600).count(p.Status.OK)
        except RemoteError as exc:
            errors.append(str(exc))
    # The connection stays usable after a refusal, and the attacker writes on, unpinned.
    written = sum(s == p.Status.OK for step in range(15)
                  for s in attacker_put(conn, [f"evil/u{step}-{i}" for i in range(4)]))
    held = kept(victim, keys)
    print(f"long pins: victim holds {held}/{WORKING_SET} blocks; attacker pinned {pinned} MiB "
          f"({len(errors)} pinned PUTs refused), then wrote {written} MiB unpinned; "
          f"errors: {str(forever.value)[:90]!r}, {errors[:1]}")
    assert held >= WORKING_SET // 2
    assert errors and all("quota exceeded" in e and "pinned quota" in e for e in errors)
    assert pinned <= 16
    # Through the client library: a quota refusal is its own error, and the agent is not taken for down.
    with pytest.raises(KVPoolQuotaError, match="maxPinSeconds"):
        victim.batch_put(["hot"], [b"h" * 4096], pin_seconds=2**32 - 1)
    assert victim.batch_put(["hot"], [b"h" * 4096], pin_seconds=60) == [1]
    conn.close()
    victim.close()


@contextlib.contextmanager
def from_address(source: str) -> Iterator[None]:
    """New connections of this process leave from ``source`` (another loopback address)."""
    original = socket.create_connection

    def create(address: Any, timeout: Any = None, source_address: Any = None, **kw: Any) -> socket.socket:
        return original(address, timeout, (source, 0), **kw)

    socket.create_connection = create  # type: ignore[assignment]
    try:
        yield
    finally:
        socket.create_connection = original  # type: ignore[assignment]


ATTACK_CONNECTIONS = 1024  # authenticated attempts from 4 addresses: what the agent's default caps admit (1024 in all, 256 each)


def test_a_thousand_idle_connections_of_one_namespace_do_not_lock_others_out(pool: dict[str, Any]) -> None:
    agent = start(pool)
    evil = credential(pool, "evil").encode()
    held: list[Connection] = []
    errors: list[str] = []
    started = time.monotonic()
    try:
        for n in range(ATTACK_CONNECTIONS):
            with from_address(f"127.0.0.{1 + n % 4}"):
                try:
                    held.append(Connection(agent.address, token=evil, timeout_seconds=30))
                except (RemoteError, OSError) as exc:
                    errors.append(str(exc))
        took = time.monotonic() - started
        try:
            with KVPoolClient(endpoints=[agent.address], token=credential(pool, "victim"), namespace="victim",
                              transport="tcp") as victim:
                stored: object = victim.batch_put(["k"], [b"v" * 4096])
                found: object = victim.batch_exists(["k"])
        except KVPoolError as exc:
            stored = found = f"refused: {exc}"
        print(f"idle connections: {ATTACK_CONNECTIONS} authenticated attempts from 4 addresses in {took:.1f} s, "
              f"{len(held)} held, {len(errors)} refused; victim connected and stored={stored} found={found}; "
              f"first error: {errors[:1]}")
        assert stored == [1] and found == [True]
        assert len(held) == 128
        assert len(errors) == ATTACK_CONNECTIONS - 128
        assert all("quota exceeded: 128 connections of credential ns:evil" in e for e in errors)
    finally:
        for conn in held:
            conn.close()
