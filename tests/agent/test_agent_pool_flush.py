"""A deleted KVPool or a node leaving it flushes its agent's DRAM tier from /dev/shm, a roll keeps it (issue 12 finding 9),
against a real API server."""

from __future__ import annotations

import asyncio
import json
import uuid
from pathlib import Path

import yaml
from support import crds_in_new_namespace

from daybreak.agent import main as agent_main
from daybreak.agent.flush import pool_keeps_node
from daybreak.agent.settings import AgentSettings
from daybreak.devenv.cluster import LocalCluster
from daybreak.pool.shm import SHM_DIR
from daybreak.testing.store_agent import cleanup_pool, free_port

REPO = Path(__file__).resolve().parents[2]


def test_deleted_pool_leaves_nothing_in_dev_shm(kube: LocalCluster, tmp_path: Path) -> None:
    ns = crds_in_new_namespace(kube, "flush")
    name = f"p{uuid.uuid4().hex[:6]}"
    pool = yaml.safe_load((REPO / "examples" / "kvpool-minimal.yaml").read_text())
    pool["metadata"] = {"name": name, "namespace": ns}
    kube.kubectl("apply", "-f", "-", stdin=json.dumps(pool))
    settings = AgentSettings(listen=f"127.0.0.1:{free_port()}", dram_bytes=16 << 20, pool_name=name,
                             pool_namespace=ns, kubeconfig=str(kube.kubeconfig), token_file=str(tmp_path / "secret"))
    server = agent_main.start_store(settings)
    try:
        assert list(SHM_DIR.glob(f"daybreak-{name}-*")), "the tier is in /dev/shm while the pool exists"

        async def follow_until_deleted() -> None:
            stop = asyncio.Event()
            task = asyncio.create_task(agent_main._follow_members(settings, server, stop))
            await asyncio.sleep(1)
            await asyncio.to_thread(kube.kubectl, "-n", ns, "delete", "kvpool", name)
            for _ in range(300):
                if getattr(server, "flush_on_stop", False):
                    break
                await asyncio.sleep(0.1)
            stop.set()
            await asyncio.wait_for(task, timeout=10)

        asyncio.run(follow_until_deleted())
        assert getattr(server, "flush_on_stop", False), "the follower saw the pool deleted"
    finally:
        agent_main.stop_store(server)  # the SIGTERM path a deleted pool's DaemonSet pod takes
    left = list(SHM_DIR.glob(f"daybreak-{name}-*"))
    cleanup_pool(name)
    print(f"deleted pool: files left in {SHM_DIR}={len(left)}")
    assert left == []


def _pool_and_node(kube: LocalCluster, *, label: str) -> tuple[str, str, str]:
    """A KVPool selecting nodes labelled ``daybreak.dev/accelerator=sunrise`` and a Node labelled ``label``."""
    ns = crds_in_new_namespace(kube, "leave")
    name = f"p{uuid.uuid4().hex[:6]}"
    node = f"node-{uuid.uuid4().hex[:6]}"
    pool = yaml.safe_load((REPO / "examples" / "kvpool-minimal.yaml").read_text())
    pool["metadata"] = {"name": name, "namespace": ns}
    kube.kubectl("apply", "-f", "-", stdin=json.dumps(pool))
    kube.kubectl("apply", "-f", "-", stdin=json.dumps({
        "apiVersion": "v1", "kind": "Node", "metadata": {"name": node, "labels": {"daybreak.dev/accelerator": label}}}))
    return ns, name, node


def _tier(name: str) -> list[Path]:
    return list(SHM_DIR.glob(f"daybreak-{name}-*"))


def test_node_leaving_the_pool_flushes_a_roll_keeps(kube: LocalCluster, tmp_path: Path) -> None:
    # Issue 12 finding 9: on SIGTERM the agent asks the API whether an agent will run on this node again.
    ns, name, node = _pool_and_node(kube, label="sunrise")
    settings = AgentSettings(listen=f"127.0.0.1:{free_port()}", dram_bytes=16 << 20, pool_name=name,
                             pool_namespace=ns, node_name=node, kubeconfig=str(kube.kubeconfig),
                             token_file=str(tmp_path / "secret"))
    try:
        # A roll or restart: the pool still selects this node, so the tier stays for the next agent.
        agent_main.stop_pool_store(settings, agent_main.start_store(settings))
        kept = _tier(name)
        assert kept, "a restarting agent's tier was removed: nothing left to re-adopt"
        # The next agent re-adopts it; then the node is relabelled out of the pool's nodeSelector.
        server = agent_main.start_store(settings)
        kube.kubectl("label", "node", node, "daybreak.dev/accelerator=other", "--overwrite")
        agent_main.stop_pool_store(settings, server)
        left = _tier(name)
    finally:
        cleanup_pool(name)
    print(f"node leaving: tier files kept on a roll={len(kept)}, left after leaving={len(left)}")
    assert left == []


def test_pool_deleted_while_the_agent_was_not_watching_flushes(kube: LocalCluster, tmp_path: Path) -> None:
    # The deleted-pool watch event can be missed (watch down, agent just started): the stop decision reads the API.
    ns, name, node = _pool_and_node(kube, label="sunrise")
    settings = AgentSettings(listen=f"127.0.0.1:{free_port()}", dram_bytes=16 << 20, pool_name=name,
                             pool_namespace=ns, node_name=node, kubeconfig=str(kube.kubeconfig),
                             token_file=str(tmp_path / "secret"))
    server = agent_main.start_store(settings)
    try:
        kube.kubectl("-n", ns, "delete", "kvpool", name)
        assert not getattr(server, "flush_on_stop", False)  # nobody followed the pool: the API must decide
        agent_main.stop_pool_store(settings, server)
        left = _tier(name)
    finally:
        cleanup_pool(name)
    assert left == []


def test_unreachable_api_keeps_the_tier(tmp_path: Path) -> None:
    # Removing blocks a restart would re-adopt is the unrecoverable mistake: without an answer, keep.
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "x",
        "clusters": [{"name": "x", "cluster": {"server": f"http://127.0.0.1:{free_port()}"}}],
        "contexts": [{"name": "x", "context": {"cluster": "x", "user": "x"}}], "users": [{"name": "x", "user": {}}]}))
    name = f"p{uuid.uuid4().hex[:6]}"
    settings = AgentSettings(listen=f"127.0.0.1:{free_port()}", dram_bytes=16 << 20, pool_name=name,
                             pool_namespace="ns", node_name="n", kubeconfig=str(kubeconfig),
                             token_file=str(tmp_path / "secret"))
    try:
        agent_main.stop_pool_store(settings, agent_main.start_store(settings))
        kept = _tier(name)
    finally:
        cleanup_pool(name)
    assert kept


def test_pool_keeps_node_rule() -> None:
    pool = {"metadata": {}, "spec": {"nodeSelector": {"a": "1", "b": "2"}}}
    node = {"metadata": {"labels": {"a": "1", "b": "2", "c": "3"}}}
    assert pool_keeps_node(pool, node) == (True, "pool_selects_node")
    assert pool_keeps_node(None, node) == (False, "pool_deleted")
    assert pool_keeps_node({"metadata": {"deletionTimestamp": "2026-01-01T00:00:00Z"}}, node)[1] == "pool_deleting"
    assert pool_keeps_node(pool, None) == (False, "node_deleted")
    assert pool_keeps_node(pool, {"metadata": {"labels": {"a": "1"}}}) == (False, "node_not_selected:b")
    assert pool_keeps_node({"spec": {}}, {"metadata": {}})[0]  # no selector: every node
