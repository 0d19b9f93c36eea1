"""The SSD tier per pool and per agent, headers MACed with the pool's key, removed with the pool (issue 22 finding 2),
against real standalone agent processes sharing one SSD root."""

from __future__ import annotations

import json
import os
import shutil
import struct
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
import yaml

from daybreak.agent import main as agent_main
from daybreak.agent.settings import AgentSettings
from daybreak.agent.store.engine import BlockStore, StoreConfig
from daybreak.agent.store.tiers import SsdOwner, reclaim_ssd_orphans, ssd_directory
from daybreak.api.kvpool import KVPool
from daybreak.client import KVPoolClient
from daybreak.devenv.cluster import LocalCluster
from daybreak.operator.pool import agent_settings
from daybreak.pool.checksum import crc32c
from daybreak.pool.connection import Connection
from daybreak.testing.store_agent import LocalAgent, cleanup_pool, free_port

REPO = Path(__file__).resolve().parents[3]
MiB = 1 << 20
N = 24  # 24 MiB into an 8 MiB DRAM tier: the oldest blocks are demoted to SSD files
CRC_OFFSET = 14  # magic(4) key_len(2) size(8): where a block file's CRC-32C sits, then and now


@dataclass
class Pool:
    """One standalone pool: its name and its own secret."""

    name: str
    token_file: Path
    agents: list[LocalAgent] = field(default_factory=list)

    @property
    def token(self) -> str:
        return self.token_file.read_text().strip()


@pytest.fixture
def pools(tmp_path: Path) -> Iterator[tuple[Pool, Pool, Path]]:
    a = Pool(f"a{uuid.uuid4().hex[:8]}", tmp_path / "secret-a")
    b = Pool(f"b{uuid.uuid4().hex[:8]}", tmp_path / "secret-b")
    yield a, b, tmp_path / "ssd"
    for pool in (a, b):
        for agent in pool.agents:
            agent.kill()
        cleanup_pool(pool.name)


def start(pool: Pool, root: Path, *, port: int, keep: bool = True, extra: tuple[str, ...] = ()) -> LocalAgent:
    flags = ["--ssd-path", str(root), "--ssd", "64Mi", "--eviction", "lru", *extra]
    agent = LocalAgent(address=f"127.0.0.1:{port}", token_file=pool.token_file, pool=pool.name, dram="8Mi",
                       extra=[*flags, *(["--keep-segments"] if keep else [])])
    pool.agents.append(agent)
    return agent.start()


def values(seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, MiB, dtype=np.uint8) for _ in range(N)]


KEYS = [f"blk{i}" for i in range(N)]


def put_all(agent: LocalAgent, pool: Pool, data: list[np.ndarray]) -> None:
    with KVPoolClient(endpoints=[agent.address], token=pool.token, namespace="ns", transport="tcp") as c:
        for i in range(0, N, 4):
            assert c.batch_put(KEYS[i:i + 4], data[i:i + 4]) == [1] * 4


def get_all(agent: LocalAgent, pool: Pool) -> list[np.ndarray | None]:
    out = [np.zeros(MiB, np.uint8) for _ in KEYS]
    with KVPoolClient(endpoints=[agent.address], token=pool.token, namespace="ns", transport="tcp") as c:
        sizes = c.batch_get_into(KEYS, out)
    return [o if s is not None else None for o, s in zip(out, sizes, strict=True)]


def stats(agent: LocalAgent, pool: Pool) -> dict[str, str]:
    conn = Connection(agent.address, token=pool.token.encode())
    try:
        return conn.stats()
    finally:
        conn.close()


def block_files(root: Path) -> dict[Path, bytes]:
    return {p: p.read_bytes() for p in sorted(root.rglob("*.blk"))}


def test_another_pool_on_the_same_root_reads_none_of_the_first_pools_blocks(
        pools: tuple[Pool, Pool, Path]) -> None:
    a, b, root = pools
    port = free_port()  # the same node address for both pools: what put them in one directory before
    a_data = values(1)
    first = start(a, root, port=port)
    put_all(first, a, a_data)
    first.stop()
    a_files = block_files(root)
    assert len(a_files) >= N // 2, "pool A's blocks were demoted to SSD files"

    other = start(b, root, port=port)  # another tenant's pool, another secret, same SSD root and address
    b_held = int(stats(other, b)["blocks"])
    b_read = sum(v is not None for v in get_all(other, b))
    other.stop()
    left = block_files(root)

    again = start(a, root, port=port)  # pool A's own agent again: its SSD blocks are its own
    a_stats = stats(again, a)
    got = get_all(again, a)
    a_read = sum(v is not None and np.array_equal(v, d) for v, d in zip(got, a_data, strict=True))
    again.stop()
    print(f"blocks read across pools: {b_read} of {N} (pool B held {b_held}); pool A's SSD files={len(a_files)}, "
          f"unchanged after pool B={sum(left.get(p) == c for p, c in a_files.items())}; pool A after restart read "
          f"{a_read} of {N} (ssd blocks adopted={a_stats.get('blocks_ssd')})")
    assert b_read == 0 and b_held == 0
    assert all(left.get(p) == c for p, c in a_files.items()), "pool B adopted, rewrote or removed pool A's files"
    assert a_read == N and int(a_stats["blocks_ssd"]) >= N // 2


def test_block_files_another_key_signed_are_never_served(pools: tuple[Pool, Pool, Path]) -> None:
    a, b, root = pools
    port = free_port()
    a_data, b_data = values(1), values(2)
    first = start(a, root, port=port)
    put_all(first, a, a_data)
    first.stop()
    a_files = block_files(root)
    other = start(b, root, port=port)
    put_all(other, b, b_data)  # the same keys, other bytes, written by pool B's own agent with its own key
    other.stop()
    b_files = {p: c for p, c in block_files(root).items() if p not in a_files}

    # Plant pool B's files (valid CRC, B's MAC) over pool A's files of the same keys, and forge one more:
    # A's own file with its bytes replaced and the CRC-32C in the header made to match them.
    forged, *others = a_files
    for a_path in others:
        twin = next((p for p in b_files if p.name == a_path.name), None)
        if twin is not None:
            shutil.copyfile(twin, a_path)
    body = bytearray(forged.read_bytes())
    fake = np.random.default_rng(3).integers(0, 256, MiB, dtype=np.uint8).tobytes()
    body[-MiB:] = fake
    body[CRC_OFFSET:CRC_OFFSET + 4] = struct.pack("<I", crc32c(fake))
    forged.write_bytes(bytes(body))
    planted = sum(path.read_bytes() != content for path, content in a_files.items())
    assert planted >= N // 2

    again = start(a, root, port=port)
    got = get_all(again, a)
    again.stop()
    foreign_served = sum(v is not None and (any(np.array_equal(v, d) for d in b_data)
                                            or np.array_equal(v, np.frombuffer(fake, np.uint8))) for v in got)
    own = sum(v is not None and np.array_equal(v, d) for v, d in zip(got, a_data, strict=True))
    refused = sum(int(line.split("count=")[1].split()[0]) for line in again.lines if "event=ssd_blocks_refused" in line)
    print(f"planted files={planted}, served to pool A={foreign_served}, refused at start={refused}, "
          f"own blocks read={own} of {N}")
    assert foreign_served == 0
    assert own == N - planted and refused == planted
    assert all(v is None or np.array_equal(v, d) for v, d in zip(got, a_data, strict=True))


def test_a_clean_stop_removes_the_pools_directory(pools: tuple[Pool, Pool, Path]) -> None:
    a, _, root = pools
    agent = start(a, root, port=free_port(), keep=False)
    put_all(agent, a, values(1))
    held = len(block_files(root))
    agent.stop()
    left = list(root.iterdir())
    print(f"clean stop: SSD files while running={held}, entries left under the root={len(left)}")
    assert held >= N // 2 and left == []


def test_the_orphan_sweep_removes_a_dead_agents_directory_never_a_live_one(pools: tuple[Pool, Pool, Path]) -> None:
    a, b, root = pools
    owner = start(a, root, port=free_port())
    put_all(owner, a, values(1))
    files = len(block_files(root))
    sweeper = start(b, root, port=free_port(), keep=False, extra=("--orphan-seconds", "0"))
    alive_kept = len([p for p in block_files(root) if a.name in str(p)])
    sweeper.stop()
    owner.kill()  # a crash: nothing removed, its lock released with the process
    sweeper = start(b, root, port=free_port(), keep=False, extra=("--orphan-seconds", "0"))
    dead_left = len([p for p in block_files(root) if a.name in str(p)])
    sweeper.stop()
    print(f"orphan sweep: pool A files={files}, kept while its agent lived={alive_kept}, left after it died={dead_left}")
    assert alive_kept == files and dead_left == 0 and list(root.iterdir()) == []


def test_a_pool_created_again_under_its_name_starts_empty_and_sweeps_the_old_directory(tmp_path: Path) -> None:
    # Cluster mode names the directory after the KVPool's uid: a pool deleted and created again (new uid,
    # same secret even) never re-adopts the old one's blocks, and its first agent removes them.
    root = tmp_path / "ssd"
    secret = os.urandom(32).hex().encode()
    prefix = f"daybreak-u{uuid.uuid4().hex[:8]}"
    old = SsdOwner.for_pool(secret=secret, namespace="team", name="kv", uid="uid-1")
    new = SsdOwner.for_pool(secret=secret, namespace="team", name="kv", uid="uid-2")
    store = BlockStore(StoreConfig(prefix=prefix + "-1", dram_bytes=1 << 20, ssd_bytes=64 * MiB, ssd_owner=old,
                                   ssd_path=str(ssd_directory(root=root, owner=old, agent="10.0.0.1:7400"))))
    store.open()
    assert store.ssd is not None
    store.ssd.write("team/k", memoryview(b"x" * 4096), crc32c(b"x" * 4096))
    store.close(unlink=True)  # the pool left this node: its SSD directory goes with the DRAM tier
    assert not any(root.iterdir())
    keep = ssd_directory(root=root, owner=new, agent="10.0.0.1:7400")
    stale = ssd_directory(root=root, owner=old, agent="10.0.0.1:7400")
    stale.mkdir(parents=True)
    (stale / "ab").mkdir()
    (stale / "ab" / "x.blk").write_bytes(b"old")  # the old pool's agent died before it could remove it
    (stale.parent / "pool.json").write_text(json.dumps(old.marker()))
    (stale.parent / "pool.json").chmod(0o600)
    time.sleep(0.01)
    removed = reclaim_ssd_orphans(root=root, owner=new, keep=keep, older_than_seconds=3600)
    assert removed == 1 and not stale.parent.exists()
    assert old.dir_name != new.dir_name and old.key_id == new.key_id


def test_a_directory_marked_by_another_secret_is_refused_not_adopted(tmp_path: Path) -> None:
    # Cluster mode: the directory is named by uid, so a pool whose Secret was replaced opens the same one.
    root = tmp_path / "ssd"
    prefix = f"daybreak-u{uuid.uuid4().hex[:8]}"
    data = b"y" * 8192

    def open_store(secret: bytes) -> BlockStore:
        owner = SsdOwner.for_pool(secret=secret, namespace="team", name="kv", uid="uid-1")
        store = BlockStore(StoreConfig(prefix=prefix, dram_bytes=1 << 20, ssd_bytes=64 * MiB, ssd_owner=owner,
                                       ssd_path=str(ssd_directory(root=root, owner=owner, agent="10.0.0.1:7400"))))
        store.open()
        return store

    first = open_store(b"1" * 64)
    assert first.ssd is not None
    first.ssd.write("team/k", memoryview(data), crc32c(data))
    first.close()
    again = open_store(b"1" * 64)
    readopted = len(again.blocks)
    again.close()
    rotated = open_store(b"2" * 64)
    try:
        refused = rotated.metrics.registry.get_sample_value("daybreak_store_ssd_refused_blocks_total",
                                                            {"reason": "foreign_dir"})
        assert readopted == 1 and len(rotated.blocks) == 0 and refused == 1
        assert not list(root.rglob("*.blk"))  # refused files are removed, never served later
    finally:
        rotated.close(unlink=True)
        cleanup_pool(prefix.removeprefix("daybreak-"))


def test_pools_with_different_secrets_never_share_a_directory() -> None:
    a = SsdOwner.for_pool(secret=b"a" * 64, namespace="", name="standalone")
    b = SsdOwner.for_pool(secret=b"b" * 64, namespace="", name="standalone")
    assert a.dir_name != b.dir_name and not a.marker_ok(b.marker())
    head = struct.pack("<4sHQI16s", b"DBS2", 1, 1, 0, b"\0" * 16)
    assert a.header_mac(head, b"k") != b.header_mac(head, b"k")


def test_the_operator_names_the_pools_directory_after_its_uid() -> None:
    raw = yaml.safe_load((REPO / "examples" / "kvpool-minimal.yaml").read_text())
    raw["metadata"] |= {"namespace": "team", "uid": "0d4c-uid"}
    raw["spec"]["tiers"]["ssd"] = {"path": "/var/lib/daybreak/kv", "bytesPerNode": "1Gi"}
    settings = AgentSettings.model_validate(agent_settings(KVPool.model_validate(raw)))
    assert settings.pool_uid == "0d4c-uid" and settings.ssd_path == "/var/lib/daybreak/kv"


def test_a_deleted_pools_agent_removes_its_ssd_directory_a_roll_keeps_it(kube: LocalCluster, tmp_path: Path) -> None:
    # The cluster path: the SIGTERM stop decision (main.stop_pool_store) that removes the DRAM tier removes the
    # pool's SSD directory too, and keeps both on a roll.
    kube.kubectl("apply", "--server-side", "-f", str(REPO / "crds"))
    kube.kubectl("wait", "--for=condition=Established", "--timeout=60s", "crd/kvpools.daybreak.dev")
    ns, name, node = f"ssd-{uuid.uuid4().hex[:6]}", f"p{uuid.uuid4().hex[:6]}", f"node-{uuid.uuid4().hex[:6]}"
    kube.kubectl("create", "namespace", ns)
    raw = yaml.safe_load((REPO / "examples" / "kvpool-minimal.yaml").read_text())
    raw["metadata"] = {"name": name, "namespace": ns}
    kube.kubectl("apply", "-f", "-", stdin=json.dumps(raw))
    kube.kubectl("apply", "-f", "-", stdin=json.dumps({
        "apiVersion": "v1", "kind": "Node", "metadata": {"name": node, "labels": {"daybreak.dev/accelerator": "sunrise"}}}))
    uid = kube.kubectl("-n", ns, "get", "kvpool", name, "-o", "jsonpath={.metadata.uid}").stdout.strip()
    root = tmp_path / "ssd"
    settings = AgentSettings(listen=f"127.0.0.1:{free_port()}", dram_bytes=1 << 20, ssd_path=str(root),
                             ssd_bytes=64 * MiB, pool_name=name, pool_namespace=ns, pool_uid=uid, node_name=node,
                             kubeconfig=str(kube.kubeconfig), token_file=str(tmp_path / "secret"))
    try:
        server = agent_main.start_store(settings)
        data = b"k" * 4 * MiB
        server.store.ssd.write(f"{ns}/k", memoryview(data), crc32c(data))
        agent_main.stop_pool_store(settings, server)  # a roll: the pool still selects the node
        kept = [p.relative_to(root) for p in root.rglob("*.blk")]
        server = agent_main.start_store(settings)
        adopted = int(server.store.stats()["blocks"])
        kube.kubectl("-n", ns, "delete", "kvpool", name)
        agent_main.stop_pool_store(settings, server)
        left = list(root.iterdir())
    finally:
        cleanup_pool(name)
    print(f"cluster: SSD files kept on a roll={len(kept)} (under {kept[0].parts[0] if kept else '-'}), "
          f"re-adopted={adopted}, entries left after the pool was deleted={len(left)}")
    assert len(kept) == 1 and kept[0].parts[0] == f"{ns}_{name}_{uid}" and adopted == 1
    assert left == []
