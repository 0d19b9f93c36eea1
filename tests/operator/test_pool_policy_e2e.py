"""Several pools on one node, end to end: a real operator process on the full local cluster (scheduler,
kwok, the process kubelet running the agents).

Issue 22 finding 5: every agent used to take host port 9401 for /metrics, so a second pool's agent stayed
Pending on a node that already ran one. Each pool now has its own pair of ports (spec.agent.port and the
next one), so two pools whose nodeSelectors pick the same node both run there.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from daybreak.devenv.cluster import LocalCluster
from daybreak.testing import e2e
from daybreak.testing.operator_process import OperatorProcess

pytestmark = pytest.mark.e2e

NS = "pools-e2e"
NODE = "daybreak-node-0"
PORTS = {"pool-x": 7420, "pool-y": 7422}


def _pool(name: str, port: int) -> dict[str, Any]:
    # No transport list: the default one (rdma is opt-in), so the agents run non-root.
    return {"apiVersion": "daybreak.dev/v1alpha1", "kind": "KVPool", "metadata": {"name": name, "namespace": NS},
            "spec": {"nodeSelector": {"kubernetes.io/hostname": NODE}, "tiers": {"dram": {"bytesPerNode": "64Mi"}},
                     "agent": {"port": port}}}


@pytest.fixture(scope="module")
def ns(cluster: LocalCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[e2e.E2ENamespace]:
    logs = tmp_path_factory.mktemp("pools-e2e")
    space = e2e.E2ENamespace(cluster, NS).open()
    operator = OperatorProcess(kubeconfig=cluster.kubeconfig, log_path=logs / "op.log", namespace=NS,
                               identity="op-pools", lease_namespace=NS, resync_seconds=3.0)
    try:
        operator.start()
        yield space
    finally:
        for name in PORTS:
            cluster.kubectl("delete", "kvpool", "-n", NS, name, "--wait=true", "--timeout=60s", check=False)
        operator.stop()
        space.close()


def test_two_pools_selecting_the_same_node_both_run_their_agents_there(cluster: LocalCluster,
                                                                       ns: e2e.E2ENamespace) -> None:
    for name, port in PORTS.items():
        resp = ns.client.post(f"/apis/daybreak.dev/v1alpha1/namespaces/{NS}/kvpools", json=_pool(name, port))
        assert resp.status_code == 201, resp.text

    def running() -> dict[str, list[dict[str, Any]]] | None:
        pods = (ns.get(f"/api/v1/namespaces/{NS}/pods?labelSelector=app.kubernetes.io/component=agent") or {})
        by_pool: dict[str, list[dict[str, Any]]] = {}
        for p in pods.get("items", []):
            if p["status"].get("phase") == "Running":
                by_pool.setdefault(p["metadata"]["labels"]["daybreak.dev/pool"], []).append(p)
        return by_pool if set(by_pool) == set(PORTS) else None

    def describe() -> str:
        return cluster.kubectl("get", "pods", "-n", NS, "-o", "wide", check=False).stdout + cluster.kubectl(
            "get", "events", "-n", NS, check=False).stdout[-3000:]

    agents = e2e.wait_for("both pools' agents Running", running, timeout=120, diagnose=describe)
    for name, port in PORTS.items():
        (pod,) = agents[name]
        assert pod["spec"]["nodeName"] == NODE
        (container,) = pod["spec"]["containers"]
        assert {p["name"]: p["hostPort"] for p in container["ports"]} == {"store": port, "metrics": port + 1}
        # A default pool's agent: non-root, no IPC_LOCK, no verbs devices.
        assert pod["spec"]["securityContext"]["runAsUser"] == 65532
        assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
        caps = container["securityContext"]["capabilities"]
        assert caps["drop"] == ["ALL"] and not caps.get("add")  # the API server drops the empty list
        assert "/dev/infiniband" not in {v.get("hostPath", {}).get("path") for v in pod["spec"]["volumes"]}

    def ready() -> list[str] | None:
        states = []
        for name in PORTS:
            pool = ns.get(f"/apis/daybreak.dev/v1alpha1/namespaces/{NS}/kvpools/{name}") or {}
            conds = {c["type"]: c["status"] for c in (pool.get("status") or {}).get("conditions") or []}
            states.append(conds.get("Ready", ""))
        return states if states == ["True", "True"] else None

    e2e.wait_for("both pools Ready (their agents serve)", ready, timeout=120, diagnose=describe)
    groups = {pod["spec"]["securityContext"]["runAsGroup"] for pods in agents.values() for pod in pods}
    assert len(groups) == 2  # each pool's segments belong to its own group
