"""`daybreak dev down` then `daybreak dev up` on one cluster directory: the serving path comes back.

A cluster of its own (the CLI's, not the session fixture: this test stops it), a KVPool and a sim
PDDeployment under a real operator process, then ``dev down`` and ``dev up`` on the same directory. The
process kubelet starts every pod again: each must come back as a new process with exactly one
address (the one it had, when the cluster got its address slot back), its status written afresh, the
router answering on its pod address and a short load through it with no failure. Before the fix the
restarted pods got a second address appended to ``status.podIPs``, the API server refused every later
status (422), and the pods' stale status from before ``dev down`` stayed.
"""

from __future__ import annotations

import fcntl
import json
import os
import ssl
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest
import yaml

from daybreak.devenv import kubelet as kubelet_mod
from daybreak.devenv import tools
from daybreak.devenv.cluster import LocalCluster
from daybreak.testing import e2e
from daybreak.testing.operator_process import OperatorProcess

NS = "restart-e2e"
POOL = "kv-restart"
PDD = "sim-restart"
# 2 layers x 2 KV heads x head size 16, bf16, 16-token blocks: 4 KiB per block (cheap on 2 cores).
LAYOUT = {"numLayers": 2, "numKVHeads": 2, "headDim": 16, "blockTokens": 16}
T = TypeVar("T")


class DevCluster:
    """A cluster run by the CLI in ``directory``: ``dev up``/``dev down``, kubectl and an admin client."""

    def __init__(self, directory: Path, logs: Path) -> None:
        self.directory, self.logs = directory, logs
        self.kubeconfig = directory / "kubeconfig"
        self.operator: OperatorProcess | None = None

    def dev(self, *args: str, timeout: float = 360) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "daybreak", "dev", *args, "--dir", str(self.directory)],
                              capture_output=True, text=True, timeout=timeout, env=e2e.child_env())

    def up(self) -> None:
        out = self.dev("up", "--nodes", "2", "--devices-per-node", "8")
        assert out.returncode == 0, out.stdout + out.stderr + self.supervisor_log()
        self.operator = OperatorProcess(kubeconfig=self.kubeconfig, log_path=self.logs / "operator.log",
                                        namespace=NS, identity="restart-e2e", lease_namespace=NS,
                                        resync_seconds=5.0).start()

    def down(self, *, purge: bool = False) -> subprocess.CompletedProcess[str]:
        if self.operator is not None:  # out of cluster, it holds the old apiserver's address: stop it first
            self.operator.stop()
            self.operator = None
        return self.dev("down", *(["--purge"] if purge else []), timeout=120)

    def kubectl(self, *args: str, stdin: str | None = None) -> str:
        out = subprocess.run([str(tools.find("kubectl")), f"--kubeconfig={self.kubeconfig}", *args],
                             capture_output=True, text=True, input=stdin, timeout=120)
        assert out.returncode == 0, f"kubectl {' '.join(args)}: {out.stdout}{out.stderr}"
        return out.stdout

    def api(self) -> httpx.Client:
        """An admin client built from the kubeconfig `dev up` wrote (its server and certificates)."""
        config = json.loads(self.kubeconfig.read_text())
        cluster, user = config["clusters"][0]["cluster"], config["users"][0]["user"]
        context = ssl.create_default_context(cafile=cluster["certificate-authority"])
        context.load_cert_chain(user["client-certificate"], user["client-key"])
        return httpx.Client(base_url=cluster["server"], verify=context, timeout=30.0)

    def get(self, path: str) -> dict[str, Any]:
        with self.api() as api:
            resp = api.get(path)
            resp.raise_for_status()
            return dict(resp.json())

    def pods(self) -> list[dict[str, Any]]:
        return list(self.get(f"/api/v1/namespaces/{NS}/pods").get("items") or [])

    def node_addresses(self) -> dict[str, str]:
        return {n["metadata"]["name"]: next(a["address"] for a in n["status"]["addresses"]
                                            if a["type"] == "InternalIP")
                for n in self.get("/api/v1/nodes")["items"]}

    def supervisor_log(self) -> str:
        path = self.directory / "supervisor.log"
        return path.read_text(errors="replace")[-3000:] if path.exists() else ""

    def diagnose(self) -> str:
        lines = [f"--- supervisor ---\n{self.supervisor_log()}"]
        if self.operator is not None:
            lines.append(f"--- operator ---\n{self.operator.log()[-2000:]}")
        for log in sorted((self.directory / "pods").glob(f"{NS}_*/*.log")):
            lines.append(f"--- {log.parent.name}/{log.name} ---\n{log.read_text(errors='replace')[-1500:]}")
        return "\n".join(lines)

    def wait_for(self, what: str, probe: Callable[[], T | None], *, timeout: float = 240.0) -> T:
        return e2e.wait_for(what, probe, timeout=timeout, diagnose=self.diagnose)


def _pid(pod: dict[str, Any]) -> int:
    """The pid of the pod's first container as its status says (0 when none)."""
    statuses = (pod.get("status") or {}).get("containerStatuses") or [{}]
    return int(str(statuses[0].get("containerID") or "process://0").removeprefix("process://"))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is dead for our purpose
        return f.read().split()[2] != "Z"


def _addresses(pod: dict[str, Any]) -> tuple[str, list[str]]:
    status = pod.get("status") or {}
    return str(status.get("podIP") or ""), [str(i.get("ip")) for i in status.get("podIPs") or []]


def _pdd_ready(cluster: DevCluster) -> bool:
    pdd = cluster.get(f"/apis/daybreak.dev/v1alpha1/namespaces/{NS}/pddeployments/{PDD}")
    return any(c["type"] == "Ready" and c["status"] == "True"
               for c in (pdd.get("status") or {}).get("conditions") or [])


def _router_url(cluster: DevCluster) -> str:
    (router,) = [p for p in cluster.pods() if (p["metadata"].get("labels") or {}).get("daybreak.dev/role") == "router"
                 and e2e.is_ready(p)]
    return f"http://{router['status']['podIP']}:8000"


def _answers(url: str) -> bool:
    """A completion through the router at ``url`` comes back whole."""
    resp = httpx.post(f"{url}/v1/completions", json={"model": "sim/tiny", "prompt": "After a restart. " * 30,
                                                     "max_tokens": 4}, timeout=60)
    return resp.status_code == 200 and bool(resp.json()["choices"][0]["text"])


def test_a_pod_started_again_keeps_its_address_while_it_is_this_clusters_and_free(tmp_path: Path) -> None:
    kubelet = kubelet_mod.ProcessKubelet(directory=tmp_path, server="https://x", ca_cert=tmp_path / "ca",
                                         api_factory=lambda: None,  # type: ignore[arg-type,return-value]
                                         slot=kubelet_mod.AddressSlot(9))
    assert kubelet.allocate_ip("a", previous="127.9.3.7") == "127.9.3.7"
    assert kubelet.allocate_ip("a", previous="127.9.3.8") == "127.9.3.7"  # one address per pod while it lives
    taken = kubelet.allocate_ip("b", previous="127.9.3.7")  # another pod holds it: a fresh one
    for previous in ("127.8.1.7",  # another cluster's slot
                     "127.9.0.1",  # a node's address, never a pod's
                     "127.9.1.255", "not-an-address", ""):
        fresh = kubelet.allocate_ip(f"uid-{previous}", previous=previous)
        assert fresh != previous and fresh.startswith("127.9.") and not fresh.startswith("127.9.0."), fresh
    assert taken != "127.9.3.7" and taken.startswith("127.9.")


def test_a_status_on_a_new_address_replaces_the_old_one_at_the_api_server(kube: LocalCluster,
                                                                           tmp_path: Path) -> None:
    """The process kubelet's status write after a restart on another address (the real API server's
    strategic merge would otherwise append it to podIPs and refuse the pod with 422)."""
    ns = "restart-status"
    with kube.api() as api:
        assert api.post("/api/v1/namespaces", json={"metadata": {"name": ns}}).status_code == 201
        api.post(f"/api/v1/namespaces/{ns}/serviceaccounts", json={"metadata": {"name": "default"}})
        body = {"metadata": {"name": "p"}, "spec": {"nodeName": "n0", "automountServiceAccountToken": False,
                                                    "containers": [{"name": "c", "image": "daybreak",
                                                                    "command": ["daybreak", "router"]}]}}
        resp = api.post(f"/api/v1/namespaces/{ns}/pods", json=body)
        assert resp.status_code == 201, resp.text
        pod = resp.json()
        # What the kubelet before the restart published.
        old = {"status": {"phase": "Running", "podIP": "127.9.1.1", "podIPs": [{"ip": "127.9.1.1"}],
                          "hostIP": "127.9.0.1", "hostIPs": [{"ip": "127.9.0.1"}],
                          "conditions": [{"type": "PodScheduled", "status": "True"}],
                          "containerStatuses": [{"name": "c", "image": "daybreak", "imageID": "", "ready": True,
                                                 "restartCount": 2, "containerID": "process://4242",
                                                 "state": {"running": {"startedAt": "2026-01-01T00:00:00Z"}},
                                                 "lastState": {}}]}}
        resp = api.patch(f"/api/v1/namespaces/{ns}/pods/p/status", content=json.dumps(old),
                         headers={"Content-Type": "application/strategic-merge-patch+json"})
        assert resp.status_code == 200, resp.text
        kubelet = kubelet_mod.ProcessKubelet(directory=tmp_path, server=kube.server, ca_cert=tmp_path / "ca",
                                             api_factory=kube.api, slot=kubelet_mod.AddressSlot(8))
        worker = kubelet_mod.PodWorker(kubelet, pod)
        worker.pod_ip, worker.host_ip = "127.8.1.4", "127.8.0.1"
        worker._publish(api, pod)
        status = api.get(f"/api/v1/namespaces/{ns}/pods/p").json()["status"]
        api.delete(f"/api/v1/namespaces/{ns}", params={"propagationPolicy": "Background"})
    assert worker.last_status is not None, "the status patch was refused"
    assert (status["podIP"], status["podIPs"]) == ("127.8.1.4", [{"ip": "127.8.1.4"}])
    assert (status["hostIP"], status["hostIPs"]) == ("127.8.0.1", [{"ip": "127.8.0.1"}])
    # The container is the new kubelet's, not a mix of the old process's state and the new one's.
    (container,) = status["containerStatuses"]
    assert list(container["state"]) == ["waiting"] and container["restartCount"] == 0, container
    assert "containerID" not in container and container["ready"] is False, container
    # The rest still merges: the scheduler's condition stays beside the kubelet's.
    assert {c["type"] for c in status["conditions"]} >= {"PodScheduled", "Ready", "ContainersReady"}


@pytest.fixture
def dev_cluster(tmp_path: Path) -> Iterator[DevCluster]:
    cluster = DevCluster(tmp_path / "dev", tmp_path / "logs")
    try:
        yield cluster
    finally:
        down = cluster.down(purge=True)
        assert down.returncode == 0, down.stdout + down.stderr
        assert not kubelet_mod.shm_root(cluster.directory).exists()


def _hold_slot(index: int) -> kubelet_mod.AddressSlot:
    """Take address slot ``index`` as another cluster would (its lock file); ``release()`` it as that cluster
    would, which removes the file."""
    fd = os.open(kubelet_mod.SLOT_LOCK_DIR / f"{index}.lock", os.O_RDWR | os.O_CREAT, 0o666)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return kubelet_mod.AddressSlot(index, fd)


def _slot_of(addresses: dict[str, str]) -> int:
    (index,) = {int(a.split(".")[1]) for a in addresses.values()}
    return index


def _restart(cluster: DevCluster, tmp_path: Path, *, take_slot: bool) -> None:
    """``dev down``, ``dev up``; every pod back as a new process with one address, the router serving a load."""
    before = {p["metadata"]["uid"]: p for p in cluster.pods()}
    nodes_before = cluster.node_addresses()
    down = cluster.down()
    assert down.returncode == 0, down.stdout + down.stderr
    assert not any(_alive(_pid(p)) for p in before.values())
    held = _hold_slot(_slot_of(nodes_before)) if take_slot else None
    try:
        cluster.up()
    finally:
        if held is not None:
            held.release()

    def restarted() -> list[dict[str, Any]] | None:
        pods = cluster.pods()
        fresh = [p for p in pods if e2e.is_ready(p) and p["metadata"]["uid"] in before
                 and _pid(p) != _pid(before[p["metadata"]["uid"]]) and _alive(_pid(p))]
        return pods if len(fresh) == len(before) == len(pods) else None

    # New processes whose status got through: before the fix every status patch was refused and the
    # pods kept their pre-down status (old pids of dead processes, the old Ready).
    pods = cluster.wait_for("every pod running again with its status written by the new kubelet", restarted)
    nodes_after = cluster.node_addresses()
    moved = _slot_of(nodes_after) != _slot_of(nodes_before)
    # Without our hold the slot is normally ours again; another cluster on this machine may have taken it.
    assert moved or not take_slot, (nodes_before, nodes_after)
    for pod in pods:
        name, status = pod["metadata"]["name"], pod["status"]
        ip, ips = _addresses(pod)
        assert ips == [ip] and ip, (name, status)
        old_ip, _ = _addresses(before[pod["metadata"]["uid"]])
        if moved:  # its address slot was taken meanwhile: every pod has a new address, in the new slot
            assert ip != old_ip and ip.startswith(f"127.{_slot_of(nodes_after)}."), (name, old_ip, ip)
        else:  # the cluster got its address slot back: every pod keeps its address
            assert ip == old_ip, (name, old_ip, ip)
        host_ips = [i["ip"] for i in status.get("hostIPs") or []]
        assert host_ips == [status["hostIP"]] == [nodes_after[pod["spec"]["nodeName"]]], (name, status)
    cluster.wait_for("the PDDeployment Ready after the restart", lambda: _pdd_ready(cluster))
    url = cluster.wait_for("the router answering on its pod address", lambda: (
        u := _router_url(cluster)) and _answers(u) and u, timeout=120)
    summary = e2e.run_load(url, tmp_path / f"load-{int(take_slot)}.json",
                           ["--sessions", "4", "--turns", "2", "--rate", "2", "--system-tokens", "256",
                            "--user-tokens", "32", "--output-tokens", "4", "--duration", "30"], timeout=180)
    assert summary["requests"] == 8 and summary["failed_requests"] == 0, summary.get("errors")
    for pod in cluster.pods():  # still one address each after the load
        ip, ips = _addresses(pod)
        assert ips == [ip], (pod["metadata"]["name"], pod["status"])


@pytest.mark.e2e
@pytest.mark.timeout(1200)  # three cluster starts and two pod restarts on a shared 2-core machine
def test_dev_down_then_up_brings_every_pod_back_with_one_address_and_the_router_serves(
        dev_cluster: DevCluster, tmp_path: Path) -> None:
    cluster = dev_cluster
    cluster.up()
    cluster.kubectl("apply", "-f", str(e2e.CRDS))
    cluster.kubectl("apply", "-f", "-", stdin=e2e.agent_rbac())
    cluster.kubectl("create", "namespace", NS)
    cluster.wait_for("the namespace's default ServiceAccount", lambda: cluster.get(
        f"/api/v1/namespaces/{NS}/serviceaccounts/default"), timeout=60)
    pool = {"apiVersion": "daybreak.dev/v1alpha1", "kind": "KVPool", "metadata": {"name": POOL},
            "spec": {"nodeSelector": {"daybreak.dev/accelerator": "sunrise"},
                     "tiers": {"dram": {"bytesPerNode": "64Mi"}}, "transport": {"preference": ["shm", "tcp"]}}}
    pdd = {"apiVersion": "daybreak.dev/v1alpha1", "kind": "PDDeployment", "metadata": {"name": PDD},
           "spec": {"poolRef": {"name": POOL}, "model": {"name": "sim/tiny", "revision": "r", "kvLayout": LAYOUT},
                    "engine": {"kind": "sim", "args": ["--time-scale", "0.1"]},
                    "prefill": {"replicas": 1}, "decode": {"replicas": 1}}}
    cluster.kubectl("apply", "-n", NS, "-f", "-", stdin=yaml.safe_dump_all([pool, pdd]))
    cluster.wait_for("the PDDeployment Ready", lambda: _pdd_ready(cluster))
    assert _answers(_router_url(cluster))
    # The agents (one per node, hostNetwork), prefill, decode and the router: every kind of process pod.
    names = sorted(p["metadata"]["name"] for p in cluster.pods())
    assert len(names) == 5, names
    # A router replaced once: its new pod got the next address, not one of the first three a kubelet
    # starting afresh hands out, so after a restart only a kept address can match what it had.
    (router,) = [p for p in cluster.pods() if p["metadata"]["labels"].get("daybreak.dev/role") == "router"]
    cluster.kubectl("delete", "pod", "-n", NS, router["metadata"]["name"], "--wait=false")
    cluster.wait_for("a new router Ready, the old one gone", lambda: len(cluster.pods()) == len(names) and (
        u := _router_url(cluster)) != f"http://{router['status']['podIP']}:8000" and _answers(u))
    # The usual restart: the cluster gets its address slot back, every pod keeps its address.
    _restart(cluster, tmp_path, take_slot=False)
    # Its slot taken by another cluster meanwhile: nodes and pods move to the new slot, one address each.
    _restart(cluster, tmp_path, take_slot=True)
