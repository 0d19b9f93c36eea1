"""A deleted KVPool flushes its agent's DRAM tier from /dev/shm (issue 12 finding 9), against a real API server."""

from __future__ import annotations

import asyncio
import json
import uuid
from pathlib import Path

import yaml

from daybreak.agent import main as agent_main
from daybreak.agent.settings import AgentSettings
from daybreak.devenv.cluster import LocalCluster
from daybreak.pool.shm import SHM_DIR
from daybreak.testing.store_agent import cleanup_pool, free_port

REPO = Path(__file__).resolve().parents[2]


def test_deleted_pool_leaves_nothing_in_dev_shm(kube: LocalCluster, tmp_path: Path) -> None:
    kube.kubectl("apply", "--server-side", "-f", str(REPO / "crds"))
    kube.kubectl("wait", "--for=condition=Established", "--timeout=60s", "crd/kvpools.daybreak.dev")
    ns = f"flush-{uuid.uuid4().hex[:6]}"
    name = f"p{uuid.uuid4().hex[:6]}"
    kube.kubectl("create", "namespace", ns)
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
