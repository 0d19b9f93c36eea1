"""`daybreak status` and `kubectl daybreak status` against a real API server and a real agent's metrics.

The objects are written as the operator and the agents write them: spec through the API, status through
the status subresource, the KVNode status from the agent's own publish code over a fixture sysfs tree. One
pool endpoint is a live standalone agent serving /metrics (blocks were put and read through the client, so
it has hits and a miss); the other (::1, where the IPv4-only metrics server does not listen) must show as
unreachable, not fail the command.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from daybreak.agent.publish import kvnode_status
from daybreak.agent.registration import Registrar
from daybreak.agent.runtime.base import DeviceInfo, PeerLink
from daybreak.agent.topology import build
from daybreak.agent.topology.sysfs import snapshot
from daybreak.api.registry import CRD_KINDS
from daybreak.client import KVPoolClient
from daybreak.devenv import tools
from daybreak.devenv.cluster import LocalCluster
from daybreak.operator.pool import PoolNames
from daybreak.testing.store_agent import LocalAgent, cleanup_pool, free_port

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
NS = "status-test"
POOL = "cache"
NODE = "status-node-1"
DEAD_NODE = "status-node-2"
BOX4_BUSES = ["0000:03:00.0", "0000:04:00.0", "0000:12:00.0", "0000:13:00.0"]


def _kubectl(kube: LocalCluster, *args: str, stdin: str | None = None) -> str:
    return kube.kubectl(*args, stdin=stdin).stdout


def _status(kube: LocalCluster, plural: str, name: str, status: dict[str, Any], *, namespaced: bool = True) -> None:
    where = ["-n", NS] if namespaced else []
    _kubectl(kube, *where, "patch", plural, name, "--subresource=status", "--type=merge",
             "-p", json.dumps({"status": status}))


@pytest.fixture(scope="module")
def agent(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LocalAgent, int]]:
    """A standalone agent with /metrics, two blocks put, both read back (hits) and one key missed."""
    tmp = tmp_path_factory.mktemp("status-agent")
    pool = f"st{uuid.uuid4().hex[:8]}"
    metrics_port = free_port()
    live = LocalAgent(address=f"127.0.0.1:{free_port()}", token_file=tmp / "token", pool=pool, dram="64Mi",
                      extra=["--metrics-port", str(metrics_port)])
    live.start()
    try:
        token = (tmp / "token").read_text().strip()
        with KVPoolClient(endpoints=[live.address], token=token, namespace="ns", transport="tcp") as client:
            assert client.batch_put(["a", "b"], [b"x" * 4096, b"y" * 4096]) == [1, 1]
            buffers = [bytearray(4096), bytearray(4096), bytearray(4096)]
            assert client.batch_get_into(["a", "b", "missing"], buffers) == [4096, 4096, None]
            assert bytes(buffers[0]) == b"x" * 4096 and bytes(buffers[1]) == b"y" * 4096
        yield live, metrics_port
    finally:
        live.kill()
        cleanup_pool(pool)


@pytest.fixture(scope="module")
def objects(kube: LocalCluster, agent: tuple[LocalAgent, int]) -> LocalCluster:
    live, metrics_port = agent
    _kubectl(kube, "apply", "-f", str(ROOT / "crds"))
    _kubectl(kube, "wait", "--for=condition=Established", "--timeout=60s", *(f"crd/{m.crd.name}" for m in CRD_KINDS))
    if kube.kubectl("get", "namespace", NS, check=False).returncode != 0:
        _kubectl(kube, "create", "namespace", NS)
    host, port = live.address.rsplit(":", 1)
    pool = {"apiVersion": "daybreak.dev/v1alpha1", "kind": "KVPool", "metadata": {"name": POOL, "namespace": NS},
            "spec": {"tiers": {"dram": {"bytesPerNode": "64Mi"}, "ssd": {"bytesPerNode": "1Gi"}},
                     "transport": {"preference": ["shm", "rdma", "tcp"]}}}
    # The agents' headless Service as the operator makes it: status finds the metrics port here.
    service = {"apiVersion": "v1", "kind": "Service",
               "metadata": {"name": PoolNames(POOL, NS).service, "namespace": NS},
               "spec": {"clusterIP": "None", "selector": {"daybreak.dev/pool": POOL},
                        "ports": [{"name": "store", "port": int(port)},
                                  {"name": "metrics", "port": metrics_port}]}}
    deployment = {
        "apiVersion": "daybreak.dev/v1alpha1", "kind": "PDDeployment", "metadata": {"name": "chat", "namespace": NS},
        "spec": {"poolRef": {"name": POOL},
                 "model": {"name": "meta-llama/Llama-3.1-8B-Instruct", "revision": "0e9e39f",
                           "kvLayout": {"numLayers": 32, "numKVHeads": 8, "headDim": 128, "dtype": "bfloat16",
                                        "blockTokens": 16}},
                 "engine": {"kind": "sim"}, "prefill": {"replicas": 2, "maxReplicas": 4},
                 "decode": {"replicas": 3}, "autoscaling": {"enabled": True}}}
    kvnode = {"apiVersion": "daybreak.dev/v1alpha1", "kind": "KVNode", "metadata": {"name": NODE},
              "spec": {"nodeName": NODE}}
    _kubectl(kube, "apply", "-f", "-", stdin=yaml.safe_dump_all([pool, service, deployment, kvnode]))
    _status(kube, "kvpool", POOL, {
        "observedGeneration": 1,
        "conditions": [
            {"type": "Ready", "status": "False", "reason": "AgentsNotReady",
             "message": "1 of 2 agents ready; node status-node-2 has no ready agent pod",
             "lastTransitionTime": "2026-12-01T09:00:00Z"},
            {"type": "Degraded", "status": "True", "reason": "AgentsNotReady",
             "message": "1 of 2 agents ready", "lastTransitionTime": "2026-12-01T09:00:00Z"}],
        "nodes": {"desired": 2, "ready": 1},
        "capacity": {"dram": 64 << 20, "ssd": 1 << 30}, "used": {"dram": 8192, "ssd": 0},
        "endpoints": [{"node": NODE, "address": host, "port": int(port), "transports": ["shm", "tcp"]},
                      # The agent's /metrics listens on IPv4 only (0.0.0.0): nothing answers on ::1.
                      {"node": DEAD_NODE, "address": "::1", "port": int(port), "transports": ["tcp"]}]})
    _status(kube, "pddeployment", "chat", {
        "observedGeneration": 1,
        "conditions": [{"type": "Ready", "status": "True", "reason": "RolesReady", "message": "all roles ready",
                        "lastTransitionTime": "2026-12-01T09:00:00Z"}],
        "prefill": {"replicas": 2, "readyReplicas": 2, "updatedReplicas": 2},
        "decode": {"replicas": 3, "readyReplicas": 2, "updatedReplicas": 3},
        "router": {"replicas": 1, "readyReplicas": 1, "updatedReplicas": 1},
        "kvNamespace": "kv-3f2a9c",
        "lastScale": {"time": "2026-12-01T09:10:00Z", "role": "prefill", "from": 1, "to": 2,
                      "reason": "TTFT p90 1.4 s above target 1.0 s for 30 s"}})
    # The agent's own publish path over a fixture machine: 4 Sunrise devices, two linked, two RDMA NICs.
    devices = [DeviceInfo(index=i, pci_bus_id=b, memory_bytes=64 << 30, vendor="sunrise", model="S2")
               for i, b in enumerate(BOX4_BUSES)]
    topo = build(snapshot(ROOT / "tests" / "fixtures" / "sysfs" / "box4"), runtime="sunrise",
                 runtime_devices=devices, peer_links=[PeerLink(a=0, b=1, links=2, kind="SL")])
    status = kvnode_status(topo, Registrar(reason="no RDMA device could be opened"), node_name=NODE,
                           capacity={"dram": 64 << 20}, used={"dram": 8192})
    _status(kube, "kvnode", NODE, status.to_dict(), namespaced=False)
    return kube


def _run(command: str, *args: str, kubeconfig: Path | str, path_bin: bool = False) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "KUBECONFIG"}
    env["KUBECONFIG"] = str(kubeconfig)
    if path_bin:
        env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    return subprocess.run([command, *args], capture_output=True, text=True, env=env, timeout=60, check=False)


def test_status_table_shows_pools_tiers_agents_deployments_and_topology_within_100_columns(
        objects: LocalCluster) -> None:
    proc = _run(str(BIN / "daybreak"), "status", "-n", NS, kubeconfig=objects.kubeconfig)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    lines = out.splitlines()
    assert max(len(line) for line in lines) <= 100, max(lines, key=len)
    pool_row = next(line for line in lines if line.startswith(f"{NS}/{POOL} ") and "Degraded" in line)
    # Two of two lookups found + one miss: 2/3 from the one reachable agent; shm and tcp are offered.
    assert "1/2" in pool_row and "66.7%" in pool_row and "shm,tcp" in pool_row
    assert "Degraded=True AgentsNotReady: 1 of 2 agents ready" in out
    assert any(line.split()[:3] == [f"{NS}/{POOL}", "dram", "64.0"] for line in lines), out
    assert any(f"{NS}/{POOL}" in line and "ssd" in line and "1.0 GiB" in line for line in lines)
    agents = lines[lines.index(f"AGENTS of {NS}/{POOL}"):]
    assert any(line.startswith(NODE) and "66.7%" in line and line.endswith("ok") for line in agents), out
    assert any(line.startswith(DEAD_NODE) and "[::1]:" in line and line.endswith(
        "metrics unreachable: connection refused") for line in agents), out
    deployment = next(line for line in lines if line.startswith(f"{NS}/chat "))
    assert deployment.split()[1:7] == [POOL, "sim", "Ready", "2/2", "2/3", "1/1"]
    assert "prefill 1->2" in deployment
    assert "kv namespace kv-3f2a9c" in out
    node_row = next(line for line in lines[lines.index("NODES"):] if line.startswith(f"{NODE} "))
    assert "4x sunrise" in node_row and "sunrise" in node_row.split()[3]
    assert "SL2 x1" in out  # the one device link, from the runtime's peer links
    assert "nearest NIC: " in out
    assert "rdma unavailable: no RDMA device could be opened" in out


def test_status_json_has_the_same_facts(objects: LocalCluster) -> None:
    proc = _run(str(BIN / "daybreak"), "status", "-n", NS, "-o", "json", kubeconfig=objects.kubeconfig)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    [pool] = data["pools"]
    assert (pool["name"], pool["health"], pool["nodes"]) == (POOL, "Degraded", {"desired": 2, "ready": 1})
    assert pool["hitRate"] == pytest.approx(2 / 3)
    assert pool["tiers"]["dram"] == {"capacityBytes": 64 << 20, "usedBytes": 8192, "hitRate": pytest.approx(2 / 3)}
    agents = {a["node"]: a for a in pool["agents"]}
    assert agents[NODE]["reachable"] and agents[NODE]["hits"] == {"dram": 2.0} and agents[NODE]["misses"] == 1.0
    assert not agents[DEAD_NODE]["reachable"] and agents[DEAD_NODE]["error"] == "connection refused"
    [deployment] = data["deployments"]
    assert deployment["decode"] == {"desired": 3, "replicas": 3, "readyReplicas": 2, "updatedReplicas": 3}
    assert deployment["lastScale"]["to"] == 2
    node = next(n for n in data["nodes"] if n["name"] == NODE)
    assert node["accelerators"] == 4 and node["models"] == ["S2"] and node["memoryBytesPerDevice"] == 64 << 30
    # 4 devices = 6 pairs: GPU0-GPU1 over the device link, GPU2-GPU3 under one switch, the rest via the host bridge.
    assert node["links"] == {"gpu-gpu": {"SL2": 1, "PIX": 1, "PHB": 4}, "gpu-nic": {"PIX": 2, "PHB": 2}}
    assert node["nearestNic"] == {f"GPU{i}": "NIC0(mlx5_0)" for i in range(4)}
    assert node["rdma"] == {"available": False, "reason": "no RDMA device could be opened"}


def test_kubectl_daybreak_status_runs_the_plugin_from_path(objects: LocalCluster) -> None:
    kubectl = str(tools.find("kubectl"))
    proc = _run(kubectl, "daybreak", "status", "-n", NS, kubeconfig=objects.kubeconfig, path_bin=True)
    assert proc.returncode == 0, proc.stderr
    assert f"{NS}/{POOL}" in proc.stdout and "NODES" in proc.stdout
    listed = _run(kubectl, "plugin", "list", kubeconfig=objects.kubeconfig, path_bin=True)
    assert str(BIN / "kubectl-daybreak") in listed.stdout


def test_an_unreachable_api_is_a_clear_error(tmp_path: Path) -> None:
    port = free_port()  # nothing listens here
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "gone",
        "clusters": [{"name": "gone", "cluster": {"server": f"https://127.0.0.1:{port}",
                                                  "insecure-skip-tls-verify": True}}],
        "users": [{"name": "u", "user": {"token": "t"}}],
        "contexts": [{"name": "gone", "context": {"cluster": "gone", "user": "u"}}]}))
    proc = _run(str(BIN / "daybreak"), "status", kubeconfig=kubeconfig)
    assert proc.returncode == 1
    assert proc.stderr.startswith(f"error: cannot reach the Kubernetes API at https://127.0.0.1:{port}")
    assert "--kubeconfig" in proc.stderr and "Traceback" not in proc.stderr
    missing = _run(str(BIN / "daybreak"), "status", kubeconfig=tmp_path / "absent")
    assert missing.returncode == 1 and "no kubeconfig at" in missing.stderr


def test_a_namespace_without_objects_says_so(objects: LocalCluster) -> None:
    proc = _run(str(BIN / "daybreak"), "status", "-n", "default", kubeconfig=objects.kubeconfig)
    assert proc.returncode == 0, proc.stderr
    assert "no KVPools in namespace default" in proc.stdout
    assert "no PDDeployments in namespace default" in proc.stdout
    everything = _run(str(BIN / "daybreak"), "status", "-A", "-o", "json", kubeconfig=objects.kubeconfig)
    assert everything.returncode == 0 and json.loads(everything.stdout)["namespace"] is None
