"""Publishing: the label and KVNode rules, and an agent process that labels its own fake node and publishes
its KVNode in the local cluster under RBAC that names that node only."""

from __future__ import annotations

import json
import os
import signal
import ssl
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from sunrise_lib.build import build as build_sunrise
from sunrise_lib.build import node as sunrise_node

from daybreak.agent.publish import (
    LABEL_ACCELERATOR,
    LABEL_COUNT,
    LABEL_GDR,
    LABEL_LINK_DOMAIN,
    LABEL_MEMORY,
    LABEL_RDMA,
    RBAC_RULES,
    kvnode_status,
    label_value,
    node_labels,
)
from daybreak.agent.registration import Registrar
from daybreak.agent.runtime.base import DeviceInfo, PeerLink
from daybreak.agent.topology import build, discover
from daybreak.agent.topology.sysfs import snapshot
from daybreak.api.node import KVNode
from daybreak.devenv.cluster import LocalCluster

REPO = Path(__file__).resolve().parent.parent
FIXTURES = REPO / "tests" / "fixtures" / "sysfs"
BOX4_BUSES = ["0000:03:00.0", "0000:04:00.0", "0000:12:00.0", "0000:13:00.0"]
BOX4_LINKS = [[0, 0, 1, 0], [0, 1, 1, 1], [2, 0, 3, 0], [2, 1, 3, 1]]


def test_labels_from_sysfs_only() -> None:
    topo = discover(FIXTURES / "dgx8")
    labels = node_labels(topo, node_name="gpu-7", rdma=False)
    # NVIDIA hardware without a loaded runtime: kind from sysfs, memory unknown (label left out)
    assert labels == {LABEL_ACCELERATOR: "nvidia", LABEL_COUNT: "8", LABEL_RDMA: "false", LABEL_GDR: "false",
                      LABEL_LINK_DOMAIN: "none"}
    assert node_labels(topo, node_name="gpu-7", rdma=True)[LABEL_GDR] == "true"
    assert node_labels(discover(FIXTURES / "nonic"), node_name="n", rdma=True)[LABEL_GDR] == "false"


def test_labels_with_a_runtime_and_links() -> None:
    devices = [DeviceInfo(index=i, pci_bus_id=b, memory_bytes=(64 << 30) - i, vendor="sunrise", model="S2")
               for i, b in enumerate(BOX4_BUSES)]
    topo = build(snapshot(FIXTURES / "box4"), runtime="sunrise", runtime_devices=devices,
                 peer_links=[PeerLink(a=0, b=1, links=2, kind="SL")])
    labels = node_labels(topo, node_name="sr-node-3", rdma=False)
    assert labels[LABEL_ACCELERATOR] == "sunrise" and labels[LABEL_COUNT] == "4"
    assert labels[LABEL_MEMORY] == str(((64 << 30) - 3) >> 20)  # the smallest device, in MiB
    assert labels[LABEL_LINK_DOMAIN] == "sr-node-3"
    host = build(snapshot(Path("/nonexistent")))
    assert node_labels(host, node_name="n", rdma=False)[LABEL_ACCELERATOR] == "none"


def test_label_value_is_always_valid() -> None:
    assert label_value("node-1.example") == "node-1.example"
    long = label_value("n" * 80)
    assert len(long) <= 63 and long.startswith("h-") and long == label_value("n" * 80)
    assert label_value("-bad-") != "-bad-"


def test_kvnode_status_validates_as_the_crd_model() -> None:
    topo = discover(FIXTURES / "numa_unknown")
    status = kvnode_status(topo, Registrar(reason="pyverbs not importable"), node_name="n1",
                           capacity={"dram": 1 << 30, "ssd": 0, "hbm": 0}, used={"dram": 4096})
    body = {"apiVersion": "daybreak.dev/v1alpha1", "kind": "KVNode", "metadata": {"name": "n1"},
            "spec": {"nodeName": "n1"}, "status": status.to_dict()}
    parsed = KVNode.from_body(body)
    assert parsed.status.rdma is not None and parsed.status.rdma.reason == "pyverbs not importable"
    wire = status.to_dict()
    assert wire["nicRank"] == {"GPU0": ["NIC0", "NIC1"], "GPU1": ["NIC1", "NIC0"]}
    assert wire["accelerators"][1]["attributes"] == {"resource.kubernetes.io/pciBusID": "0000:81:00.0",
                                                    "resource.kubernetes.io/pcieRoot": "pci0000:80"}
    assert wire["transports"] == ["tcp"] and wire["capacity"]["dram"] == 1 << 30 and wire["used"]["dram"] == 4096
    assert {"a": "GPU1", "b": "NIC1", "link": "NODE"} in wire["links"]


# -- end to end ----------------------------------------------------------------------------------------
NAMESPACE = "daybreak-agent-e2e"
NODE = "daybreak-node-9"  # our own kwok node: the shared daybreak-node-0/1 keep their labels


def _wait_for(what: str, probe: Callable[[], Any], *, timeout: float = 90.0, proc: subprocess.Popen[str] | None = None
              ) -> Any:
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            pytest.fail(f"agent exited with {proc.returncode} while waiting for {what}:\n{proc.stderr.read()}")
        last = probe()
        if last:
            return last
        time.sleep(0.5)
    pytest.fail(f"timed out waiting for {what}; last: {last!r}")


def _agent_credentials(cluster: LocalCluster, tmp: Path) -> tuple[Path, str]:
    """A ServiceAccount bound to RBAC_RULES for NODE only, and a kubeconfig with its token."""
    rules = json.loads(json.dumps(RBAC_RULES).replace("<node>", NODE))
    docs = [
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}},
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "agent", "namespace": NAMESPACE}},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
         "metadata": {"name": f"daybreak-agent-{NODE}"}, "rules": rules},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
         "metadata": {"name": f"daybreak-agent-{NODE}"},
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": f"daybreak-agent-{NODE}"},
         "subjects": [{"kind": "ServiceAccount", "name": "agent", "namespace": NAMESPACE}]},
    ]
    cluster.kubectl("apply", "-f", "-", stdin="\n---\n".join(json.dumps(d) for d in docs))
    with cluster.api() as api:
        resp = api.post(f"/api/v1/namespaces/{NAMESPACE}/serviceaccounts/agent/token",
                        json={"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
                              "spec": {"expirationSeconds": 3600}})
        assert resp.status_code == 201, resp.text
        token = resp.json()["status"]["token"]
    kubeconfig = tmp / "agent-kubeconfig"
    kubeconfig.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "agent",
        "clusters": [{"name": "local", "cluster": {"server": cluster.server,
                                                    "certificate-authority": str(cluster.pki.ca_cert)}}],
        "users": [{"name": "agent", "user": {"token": token}}],
        "contexts": [{"name": "agent", "context": {"cluster": "local", "user": "agent"}}],
    }))
    return kubeconfig, token


@pytest.mark.e2e
def test_agent_process_labels_its_node_and_publishes_kvnode(cluster: LocalCluster, tmp_path: Path) -> None:
    cluster.kubectl("apply", "-f", str(REPO / "crds" / "daybreak.dev_kvnodes.yaml"))
    cluster.kubectl("wait", "--for=condition=Established", "crd/kvnodes.daybreak.dev", "--timeout=60s")
    cluster.create_fake_nodes(1, start_index=9)
    kubeconfig, token = _agent_credentials(cluster, tmp_path)
    libdir = build_sunrise(tmp_path / "lib")
    env = {**os.environ, "PYTHONSAFEPATH": "1", "DAYBREAK_NODE_NAME": NODE, "DAYBREAK_KUBECONFIG": str(kubeconfig),
           "DAYBREAK_SYSFS_ROOT": str(FIXTURES / "box4"), "DAYBREAK_SUNRISE_LIB_DIR": str(libdir),
           "DAYBREAK_FAKE_SUNRISE": sunrise_node(BOX4_BUSES, links=BOX4_LINKS, memory_bytes=32 << 30),
           "DAYBREAK_NODE_REFRESH_SECONDS": "30", "DAYBREAK_DRAM_BYTES": str(2 << 30)}
    with cluster.api() as admin:
        # Agents the process kubelet ran earlier in the session may have labelled the shared nodes: compare.
        shared_before = admin.get("/api/v1/nodes/daybreak-node-0").json()["metadata"].get("labels") or {}
    agent = subprocess.Popen([sys.executable, "-c", "import sys; from daybreak.agent.node import main; sys.exit(main())"],
                             env=env, cwd="/", stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        with cluster.api() as admin:
            def labels_of(name: str) -> dict[str, str]:
                return dict(admin.get(f"/api/v1/nodes/{name}").json()["metadata"].get("labels") or {})

            want = {LABEL_ACCELERATOR: "sunrise", LABEL_COUNT: "4", LABEL_MEMORY: str(32 << 10), LABEL_RDMA: "false",
                    LABEL_GDR: "false", LABEL_LINK_DOMAIN: NODE}
            _wait_for("the node labels", lambda: all(labels_of(NODE).get(k) == v for k, v in want.items()),
                      proc=agent)

            kvnode_path = f"/apis/daybreak.dev/v1alpha1/kvnodes/{NODE}"
            obj = _wait_for("the KVNode status", lambda: (r := admin.get(kvnode_path)).status_code == 200
                            and (r.json().get("status") or {}).get("runtime") and r.json(), proc=agent)
            status = obj["status"]
            assert obj["spec"] == {"nodeName": NODE}
            node_uid = admin.get(f"/api/v1/nodes/{NODE}").json()["metadata"]["uid"]
            assert obj["metadata"]["ownerReferences"][0]["uid"] == node_uid
            assert status["runtime"] == "sunrise" and status["accelerator"] == "sunrise"
            assert [a["attributes"]["resource.kubernetes.io/pciBusID"] for a in status["accelerators"]] == BOX4_BUSES
            links = {(link["a"], link["b"]): link["link"] for link in status["links"]}
            assert links[("GPU0", "GPU1")] == "SL2" and links[("GPU2", "GPU3")] == "SL2"
            assert links[("GPU0", "GPU2")] == "PHB" and links[("GPU0", "NIC0")] == "PIX"
            assert status["rdma"]["available"] is False and status["rdma"]["reason"]
            assert status["transports"] == ["tcp"] and status["capacity"]["dram"] == 2 << 30
            assert status["conditions"][0]["type"] == "Ready" and status["conditions"][0]["status"] == "True"

            # Someone strips a label: the watch (field selector on our node) brings the agent back at once,
            # well before the 30 s refresh.
            admin.patch(f"/api/v1/nodes/{NODE}", json={"metadata": {"labels": {LABEL_LINK_DOMAIN: None}}},
                        headers={"Content-Type": "application/merge-patch+json"}).raise_for_status()
            _wait_for("the label to come back", lambda: labels_of(NODE).get(LABEL_LINK_DOMAIN) == NODE, timeout=20,
                      proc=agent)

            # The shared nodes were not touched, and the agent's identity could not touch them.
            assert labels_of("daybreak-node-0").get(LABEL_COUNT) == "8"
            assert labels_of("daybreak-node-0") == shared_before
            with httpx.Client(base_url=cluster.server, verify=ssl.create_default_context(cafile=cluster.pki.ca_cert),
                              headers={"Authorization": f"Bearer {token}"}, timeout=30) as agent_api:
                assert agent_api.get("/api/v1/nodes").status_code == 403  # no cluster-wide list
                assert agent_api.get("/api/v1/nodes/daybreak-node-0").status_code == 403
                assert agent_api.get(f"/api/v1/nodes/{NODE}").status_code == 200

        agent.send_signal(signal.SIGTERM)
        assert agent.wait(timeout=30) == 0
        log = agent.stderr.read() if agent.stderr else ""
        assert "runtime=sunrise status=loaded devices=4" in log
        assert "rdma status=unavailable" in log and f"node={NODE} published" in log
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.wait()

    # The KVNode belongs to its Node: deleting the node lets the garbage collector remove it.
    with cluster.api() as admin:
        admin.delete(f"/api/v1/nodes/{NODE}").raise_for_status()
        _wait_for("the KVNode to be garbage collected",
                  lambda: admin.get(f"/apis/daybreak.dev/v1alpha1/kvnodes/{NODE}").status_code == 404)
