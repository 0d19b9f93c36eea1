"""The process kubelet on the local cluster: `daybreak` pods run as real processes on their own loopback addresses.

Each pod here runs ``daybreak dev _testpod`` (a tiny HTTP server that can exit
with a code or linger after SIGTERM), so probes, restarts, deletion and logs are
checked against real processes, the real API server and the real
endpointslice/ReplicaSet machinery of the ``cluster`` fixture.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import os
import ssl
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest

from daybreak.devenv import kubelet as kubelet_mod
from daybreak.devenv.cluster import LocalCluster
from daybreak.testing import e2e

pytestmark = pytest.mark.e2e

NS = "pk-test"
T = TypeVar("T")


def wait_for(what: str, probe: Callable[[], T | None], *, timeout: float = 60.0) -> T:
    return e2e.wait_for(what, probe, timeout=timeout, interval=0.2)


def pod_manifest(name: str, *args: str, labels: dict[str, str] | None = None, probe_path: str = "/health",
            restart: str = "Always", grace: int | None = None, node: str | None = None,
            host_network: bool = False, port: int = 8080) -> dict[str, Any]:
    container: dict[str, Any] = {
        "name": "main", "image": "daybreak",
        "command": ["daybreak", "dev", "_testpod"], "args": ["--port", str(port), *args],
        "env": [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
                {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
                {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
                {"name": "NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}}],
        "ports": [{"name": "http", "containerPort": port}],
        "readinessProbe": {"httpGet": {"path": probe_path, "port": "http"}, "periodSeconds": 1,
                           "failureThreshold": 1},
    }
    spec: dict[str, Any] = {"containers": [container], "restartPolicy": restart}
    if grace is not None:
        spec["terminationGracePeriodSeconds"] = grace
    if node:
        spec["nodeName"] = node
    if host_network:
        spec["hostNetwork"] = True
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": labels or {"app": name}},
            "spec": spec}


class Pods:
    def __init__(self, cluster: LocalCluster, api: httpx.Client) -> None:
        self.cluster, self.api = cluster, api

    def create(self, body: dict[str, Any]) -> None:
        resp = self.api.post(f"/api/v1/namespaces/{NS}/pods", json=body)
        assert resp.status_code == 201, resp.text

    def get(self, name: str) -> dict[str, Any] | None:
        resp = self.api.get(f"/api/v1/namespaces/{NS}/pods/{name}")
        if resp.status_code == 404:
            return None
        resp.raise_for_status()
        return dict(resp.json())

    def ready(self, name: str) -> dict[str, Any] | None:
        pod = self.get(name)
        conds = {c["type"]: c["status"] for c in ((pod or {}).get("status") or {}).get("conditions") or []}
        return pod if conds.get("Ready") == "True" else None

    def pid(self, name: str) -> int:
        status = (self.get(name) or {})["status"]["containerStatuses"][0]
        return int(status["containerID"].removeprefix("process://"))

    def log(self, name: str) -> str:
        out = subprocess.run([sys.executable, "-m", "daybreak", "dev", "logs", name, "-n", NS,
                              "--dir", str(self.cluster.directory)], capture_output=True, text=True, timeout=30,
                             env={**os.environ, "PYTHONSAFEPATH": "1"})
        assert out.returncode == 0, out.stderr
        return out.stdout


@pytest.fixture(scope="module")
def pods(cluster: LocalCluster) -> Iterator[Pods]:
    assert cluster.kubelet is not None, "the cluster fixture runs the process kubelet"
    cluster.kubectl("create", "namespace", NS)
    api = cluster.api()
    # Pods are admitted once the ServiceAccount controller made the namespace's default account.
    wait_for("the default ServiceAccount", lambda: api.get(
        f"/api/v1/namespaces/{NS}/serviceaccounts/default").status_code == 200)
    try:
        yield Pods(cluster, api)
    finally:
        cluster.kubectl("delete", "namespace", NS, "--wait=false", check=False)
        api.close()


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead for our purpose; the kubelet reaps it.
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split()[2] != "Z"


def test_a_daybreak_pod_binds_its_loopback_address_is_ready_by_its_probe_and_in_its_endpointslice(
        pods: Pods, cluster: LocalCluster) -> None:
    pods.api.post(f"/api/v1/namespaces/{NS}/services", json={
        "apiVersion": "v1", "kind": "Service", "metadata": {"name": "web"},
        "spec": {"selector": {"tier": "web"}, "ports": [{"name": "http", "port": 80, "targetPort": "http"}]}})
    pods.create(pod_manifest("web-ok", labels={"tier": "web"}))
    pods.create(pod_manifest("web-unready", labels={"tier": "web"}, probe_path="/missing"))
    pod = wait_for("web-ok Ready", lambda: pods.ready("web-ok"))
    ip = pod["status"]["podIP"]
    assert cluster.slot is not None and ipaddress.ip_address(ip) in cluster.slot.network
    node = pod["spec"]["nodeName"]
    assert pod["status"]["hostIP"] == next(a["address"] for a in (pods.api.get(f"/api/v1/nodes/{node}").json()
                                                                   ["status"]["addresses"]) if a["type"] == "InternalIP")
    env = httpx.get(f"http://{ip}:8080/env", timeout=5).json()
    assert env["POD_IP"] == ip and env["POD_NAME"] == "web-ok" and env["POD_NAMESPACE"] == NS
    assert env["NODE_NAME"] == node
    assert env["DAYBREAK_SHM_DIR"] == str(kubelet_mod.shm_root(cluster.directory) / node)

    # The per-pod kubeconfig authenticates as the pod's ServiceAccount.
    config = json.loads(Path(env["KUBECONFIG"]).read_text())
    token = config["users"][0]["user"]["token"]
    ctx = ssl.create_default_context(cafile=config["clusters"][0]["cluster"]["certificate-authority"])
    review = httpx.post(f"{config['clusters'][0]['cluster']['server']}/apis/authentication.k8s.io/v1/"
                        "selfsubjectreviews", json={"apiVersion": "authentication.k8s.io/v1",
                                                    "kind": "SelfSubjectReview"},
                        headers={"Authorization": f"Bearer {token}"}, verify=ctx, timeout=10)
    assert review.json()["status"]["userInfo"]["username"] == f"system:serviceaccount:{NS}:default"

    # A probe that never passes: running, never Ready.
    unready = wait_for("web-unready running", lambda: (p := pods.get("web-unready")) and p["status"].get(
        "phase") == "Running" and p)
    time.sleep(3)
    unready = pods.get("web-unready") or {}
    conds = {c["type"]: c["status"] for c in unready["status"]["conditions"]}
    assert conds["Ready"] == "False" and conds["ContainersReady"] == "False"
    assert unready["status"]["containerStatuses"][0]["ready"] is False
    assert httpx.get(f"http://{unready['status']['podIP']}:8080/health", timeout=5).status_code == 200

    def slice_endpoints() -> dict[str, bool] | None:
        items = pods.api.get(f"/apis/discovery.k8s.io/v1/namespaces/{NS}/endpointslices",
                             params={"labelSelector": "kubernetes.io/service-name=web"}).json()["items"]
        out = {a: bool(e["conditions"].get("ready")) for s in items for e in s.get("endpoints") or []
               for a in e["addresses"]}
        ports = {p.get("name"): p["port"] for s in items for p in s.get("ports") or []}
        return out if len(out) == 2 and ports == {"http": 8080} else None

    endpoints = wait_for("the web EndpointSlice", slice_endpoints)
    assert endpoints == {ip: True, unready["status"]["podIP"]: False}

    # What the router does: ready endpoints of a Service, through the API.
    from daybreak.serving import kube

    async def discover() -> list[str]:
        api = await kube.load_api(str(cluster.kubeconfig))
        try:
            return await kube.ready_endpoints(api, namespace=NS, service="web")
        finally:
            await api.close()

    assert asyncio.run(discover()) == [f"{ip}:8080"]


def test_pods_that_do_not_run_daybreak_stay_kwoks(pods: Pods, cluster: LocalCluster) -> None:
    pods.create({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "kwok-only"},
                 "spec": {"containers": [{"name": "c", "image": "busybox", "command": ["sleep", "3600"]}]}})
    pod = wait_for("kwok-only Ready", lambda: pods.ready("kwok-only"))
    assert ipaddress.ip_address(pod["status"]["podIP"]) not in ipaddress.ip_network("127.0.0.0/8")
    assert "containerID" not in pod["status"]["containerStatuses"][0]
    assert not (cluster.directory / "pods" / f"{NS}_kwok-only").exists()


def test_a_crashing_container_restarts_per_restart_policy_with_the_count_in_status(pods: Pods) -> None:
    pods.create(pod_manifest("crash-always", "--exit-after", "0.3", "--exit-code", "3"))
    pods.create(pod_manifest("crash-never", "--exit-after", "0.3", "--exit-code", "3", restart="Never"))
    pods.create(pod_manifest("done-onfailure", "--exit-after", "0.3", "--exit-code", "0", restart="OnFailure"))

    def restarted() -> dict[str, Any] | None:
        status = ((pods.get("crash-always") or {}).get("status") or {}).get("containerStatuses") or [{}]
        return status[0] if status[0].get("restartCount", 0) >= 3 else None

    status = wait_for("crash-always to restart 3 times", restarted, timeout=90)
    assert status["lastState"]["terminated"]["exitCode"] == 3
    assert (pods.get("crash-always") or {})["status"]["phase"] == "Running"
    never = wait_for("crash-never Failed", lambda: (p := pods.get("crash-never")) and p["status"].get(
        "phase") == "Failed" and p)
    assert never["status"]["containerStatuses"][0]["restartCount"] == 0
    assert never["status"]["containerStatuses"][0]["state"]["terminated"]["exitCode"] == 3
    done = wait_for("done-onfailure Succeeded", lambda: (p := pods.get("done-onfailure")) and p["status"].get(
        "phase") == "Succeeded" and p)
    assert done["status"]["containerStatuses"][0]["restartCount"] == 0

    log = pods.log("crash-always")
    assert log.count("testpod exiting with 3") >= 3
    assert "restart 1" in log


def test_deletion_sends_sigterm_and_honours_the_grace_period(pods: Pods) -> None:
    pods.create(pod_manifest("term-fast", "--term-delay", "2", grace=30))
    pods.create(pod_manifest("term-stuck", "--term-delay", "600", grace=2))
    wait_for("both Ready", lambda: pods.ready("term-fast") and pods.ready("term-stuck"))
    fast, stuck = pods.pid("term-fast"), pods.pid("term-stuck")
    for name in ("term-fast", "term-stuck"):
        assert pods.api.delete(f"/api/v1/namespaces/{NS}/pods/{name}").status_code == 200
    # While the process drains the pod stays, terminating and not Ready.
    time.sleep(0.8)
    draining = pods.get("term-fast")
    assert draining is not None and draining["metadata"].get("deletionTimestamp")
    assert {c["type"]: c["status"] for c in draining["status"]["conditions"]}["Ready"] == "False"
    wait_for("term-fast gone", lambda: pods.get("term-fast") is None, timeout=30)
    wait_for("term-stuck gone", lambda: pods.get("term-stuck") is None, timeout=30)
    assert not alive(fast) and not alive(stuck)
    fast_log = (pods.cluster.directory / "pods" / f"{NS}_term-fast" / "main.log").read_text()
    stuck_log = (pods.cluster.directory / "pods" / f"{NS}_term-stuck" / "main.log").read_text()
    assert "got SIGTERM" in fast_log and "testpod stopped" in fast_log  # exited by itself, within grace
    assert "got SIGTERM" in stuck_log and "testpod stopped" not in stuck_log  # SIGKILLed at the grace period


def test_a_host_network_pod_binds_its_nodes_address(pods: Pods, cluster: LocalCluster) -> None:
    pods.create(pod_manifest("hostnet", node="daybreak-node-1", host_network=True, port=18765))
    pod = wait_for("hostnet Ready", lambda: pods.ready("hostnet"))
    assert cluster.slot is not None
    node_ip = cluster.slot.node_address(1)
    assert pod["status"]["podIP"] == pod["status"]["hostIP"] == node_ip
    assert httpx.get(f"http://{node_ip}:18765/env", timeout=5).json()["POD_IP"] == node_ip


def test_dev_up_runs_daybreak_pods_and_dev_down_leaves_no_process_or_shared_memory(tmp_path: Path) -> None:
    """The CLI path end to end on a cluster of its own: up, a pod, logs, down."""
    directory = tmp_path / "dev"
    env = {**os.environ, "PYTHONSAFEPATH": "1"}

    def dev(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "daybreak", "dev", *args, "--dir", str(directory)],
                              capture_output=True, text=True, timeout=timeout, env=env)

    up = dev("up", "--nodes", "1")
    assert up.returncode == 0, up.stdout + up.stderr
    shm = kubelet_mod.shm_root(directory)
    try:
        kubeconfig = str(directory / "kubeconfig")
        manifest = json.dumps(pod_manifest("cli-pod"))
        kubectl = [str(Path(sys.executable).parent / "kubectl"), f"--kubeconfig={kubeconfig}"]
        subprocess.run([*kubectl, "apply", "-f", "-"], input=manifest, text=True, check=True, timeout=60)

        def ready() -> str | None:
            out = subprocess.run([*kubectl, "get", "pod", "cli-pod", "-o",
                                  "jsonpath={.status.conditions[?(@.type=='Ready')].status} {.status.podIP}"],
                                 capture_output=True, text=True, timeout=30).stdout.split()
            return out[1] if out and out[0] == "True" else None

        ip = wait_for("cli-pod Ready", ready, timeout=120)
        pid = int(subprocess.run([*kubectl, "get", "pod", "cli-pod", "-o",
                                  "jsonpath={.status.containerStatuses[0].containerID}"],
                                 capture_output=True, text=True, timeout=30).stdout.removeprefix("process://"))
        assert (shm / "daybreak-node-0").is_dir()
        logs = dev("logs", "cli-pod")
        assert logs.returncode == 0 and f"testpod serving on {ip}:8080" in logs.stdout, logs.stderr
        missing = dev("logs", "no-such-pod")
        assert missing.returncode == 1 and "no log" in missing.stderr
    finally:
        down = dev("down", "--purge")
    assert down.returncode == 0, down.stdout + down.stderr
    assert not alive(pid)
    assert not shm.exists()
