"""A real Kubernetes control plane as local processes on loopback: etcd, apiserver, controllers, kwok.

Used by ``daybreak dev up``, ``make demo`` and the pytest fixtures. No
containers: every component is a binary from ``daybreak.devenv.tools``
started with its own log file under the cluster directory. kwok plays the
kubelets, so pods scheduled to the fake nodes become Running and node
Leases stay fresh (without them the node-lifecycle controller would taint
the nodes and evict everything after ~40 s). With ``process_kubelet`` (the
default) pods whose container runs ``daybreak`` are not kwok's: the process
kubelet (``daybreak.devenv.kubelet``) runs them as real local processes, each
on its own loopback address, every fake node on its own 127.0.1.N.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import ssl
import subprocess
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

import httpx
import yaml

from daybreak.api import labels as vocab
from daybreak.devenv import kubelet as kubelet_mod
from daybreak.devenv import pki as pki_mod
from daybreak.devenv import tools
from daybreak.errors import DaybreakError

SERVICE_CIDR = "10.0.0.0/24"
SERVICE_IP = "10.0.0.1"
FAKE_NODE_ANNOTATION = "kwok.x-k8s.io/node"

# accelerator kind -> extended resource name advertised by fake nodes
ACCELERATOR_RESOURCE = {"sunrise": "daybreak.dev/sunrise", "nvidia": "nvidia.com/gpu"}


class ClusterError(DaybreakError, RuntimeError):
    """A component failed to start; the message names it and its log file."""


@dataclass(frozen=True)
class ClusterSpec:
    """What to run: the fuller stack (controllers + kwok) or etcd + apiserver only (envtest style)."""

    nodes: int = 2
    devices_per_node: int = 8
    accelerator: str = "sunrise"
    controllers: bool = True
    kwok: bool = True
    # Run pods whose container command is `daybreak` or `python3 -m vllm...` as real processes (needs kwok and
    # the controllers).
    process_kubelet: bool = True
    # The interpreter vLLM pods run with; empty: the checkout's `make vllm-env` (daybreak.devenv.vllmenv).
    vllm_python: str = ""


@dataclass
class _Component:
    name: str
    args: list[str]
    process: subprocess.Popen[bytes] | None = None
    log: Path | None = None


def _terminate(component: _Component, *, grace: float) -> None:
    """SIGTERM the component's process group, SIGKILL it after ``grace`` seconds."""
    proc = component.process
    if proc is None or proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def free_port() -> int:
    """A currently free loopback TCP port."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class LocalCluster:
    """One local cluster rooted in ``directory``; use as a context manager or call start()/stop()."""

    directory: Path
    spec: ClusterSpec = field(default_factory=ClusterSpec)
    progress: Any = print

    def __post_init__(self) -> None:
        self.directory = self.directory.resolve()
        self._components: list[_Component] = []
        self.apiserver_port = 0
        self.kubeconfig = self.directory / "kubeconfig"
        self.kubelet: kubelet_mod.ProcessKubelet | None = None
        self.slot: kubelet_mod.AddressSlot | None = None

    # -- public -----------------------------------------------------------------
    @property
    def server(self) -> str:
        return f"https://127.0.0.1:{self.apiserver_port}"

    def start(self, *, timeout: float = 180.0) -> LocalCluster:
        needed = ["etcd", "kube-apiserver"]
        if self.spec.controllers:
            needed += ["kube-controller-manager", "kube-scheduler"]
        if self.spec.kwok:
            needed += ["kwok"]
        binaries = {name: tools.find(name) for name in needed}
        self.directory.mkdir(parents=True, exist_ok=True)
        (self.directory / "logs").mkdir(exist_ok=True)
        self.pki = pki_mod.generate(self.directory / "pki", service_ip=SERVICE_IP)
        deadline = time.monotonic() + timeout
        try:
            self._start_etcd(binaries["etcd"], deadline)
            self._start_apiserver(binaries["kube-apiserver"], deadline)
            self._write_kubeconfig()
            if self.spec.controllers:
                self._start_controllers(binaries, deadline)
            if self.spec.kwok:
                # This cluster's own loopback addresses (fake nodes, process pods), apart from other clusters'.
                self.slot = kubelet_mod.claim_slot(self.directory)
                self._start_kwok(binaries["kwok"])
                self.create_fake_nodes(self.spec.nodes, deadline=deadline)
                if self.spec.process_kubelet and self.spec.controllers:
                    self.kubelet = kubelet_mod.ProcessKubelet(
                        directory=self.directory, server=self.server, ca_cert=Path(self.pki.ca_cert),
                        api_factory=self.api, slot=self.slot, fake_node_annotation=FAKE_NODE_ANNOTATION,
                        progress=self.progress,
                        vllm_python=Path(self.spec.vllm_python).resolve() if self.spec.vllm_python else None,
                    ).start()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Stop the process kubelet's pods, then every component, newest first; safe to call twice."""
        if self.kubelet is not None:
            self.kubelet.stop()
            self.kubelet = None
        for component in reversed(self._components):
            _terminate(component, grace=10)
        self._components.clear()
        if self.slot is not None:
            self.slot.release()
            self.slot = None

    def restart_apiserver(self, *, downtime: float = 0.0, timeout: float = 60.0) -> None:
        """Stop kube-apiserver, stay down ``downtime`` seconds, start it again on the same port and wait for /readyz.

        For tests of clients that must ride out an apiserver outage (etcd keeps the data).
        """
        index, component = next((i, c) for i, c in enumerate(self._components) if c.name == "kube-apiserver")
        _terminate(component, grace=15)
        time.sleep(downtime)
        self._components.remove(component)
        restarted = self._spawn(component.name, component.args)
        # Keep the original position: stop() tears components down newest first.
        self._components.remove(restarted)
        self._components.insert(index, restarted)

        def ready() -> bool:
            with self.api() as api:
                return api.get("/readyz").status_code == 200

        self._wait("kube-apiserver /readyz after restart", ready, time.monotonic() + timeout)

    def pids(self) -> dict[str, int]:
        return {c.name: c.process.pid for c in self._components if c.process is not None}

    def api(self) -> httpx.Client:
        """An httpx client authenticated as cluster admin."""
        context = ssl.create_default_context(cafile=str(self.pki.ca_cert))
        context.load_cert_chain(str(self.pki.admin_cert), str(self.pki.admin_key))
        return httpx.Client(base_url=self.server, verify=context, timeout=30.0)

    def kubectl(self, *args: str, check: bool = True, stdin: str | None = None,
                timeout: float = 120) -> subprocess.CompletedProcess[str]:
        """Run kubectl against this cluster; raises ClusterError on failure when ``check``."""
        proc = subprocess.run([str(tools.find("kubectl")), f"--kubeconfig={self.kubeconfig}", *args],
                              capture_output=True, text=True, input=stdin, timeout=timeout)
        if check and proc.returncode != 0:
            raise ClusterError(f"kubectl {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout}{proc.stderr}")
        return proc

    def create_fake_nodes(self, count: int, *, deadline: float | None = None, start_index: int = 0) -> list[str]:
        """Create ``count`` kwok-managed nodes with fake accelerators and wait until they are Ready."""
        deadline = deadline or time.monotonic() + 60
        indices = range(start_index, start_index + count)
        names = [f"daybreak-node-{i}" for i in indices]
        with self.api() as api:
            for i, name in zip(indices, names, strict=True):
                if self.spec.devices_per_node > 0:  # what a real agent on this node discovers
                    kubelet_mod.write_fake_sysfs(kubelet_mod.node_dir(self.directory, name) / "sys",
                                                 accelerator=self.spec.accelerator, count=self.spec.devices_per_node)
                address = self.slot.node_address(i) if self.slot is not None else None
                resp = api.post("/api/v1/nodes", json=fake_node(name, self.spec, address=address))
                if resp.status_code == 409 and address:
                    self._readdress_node(api, name, address)
                elif resp.status_code not in (201, 409):
                    raise ClusterError(f"creating node {name}: {resp.status_code} {resp.text}")
            self.progress(f"waiting for {count} fake node(s) to become Ready")
            while True:
                ready = {
                    n["metadata"]["name"]
                    for n in api.get("/api/v1/nodes").json().get("items", [])
                    if any(c["type"] == "Ready" and c["status"] == "True" for c in n["status"].get("conditions", []))
                }
                if set(names) <= ready:
                    return names
                self._check_alive()
                if time.monotonic() > deadline:
                    raise ClusterError(f"nodes {sorted(set(names) - ready)} did not become Ready; see {self._log('kwok')}")
                time.sleep(0.5)

    def _readdress_node(self, api: httpx.Client, name: str, address: str) -> None:
        """Give an existing fake node (a restarted cluster's) this run's address if it holds another.

        A cluster started again in the same directory finds its nodes in etcd; when its usual address slot
        was taken meanwhile it runs in another one, and the node's InternalIP must move with it: the
        process kubelet binds hostNetwork pods to it and publishes it as their hostIP.
        """
        resp = api.get(f"/api/v1/nodes/{name}")
        if resp.status_code != 200:
            raise ClusterError(f"reading node {name}: {resp.status_code} {resp.text}")
        addresses = (resp.json().get("status") or {}).get("addresses") or []
        if any(a.get("type") == "InternalIP" and a.get("address") == address for a in addresses):
            return
        patch = {"status": {"addresses": [{"$patch": "replace"}, {"type": "InternalIP", "address": address},
                                          {"type": "Hostname", "address": name}]}}
        resp = api.patch(f"/api/v1/nodes/{name}/status", content=json.dumps(patch),
                         headers={"Content-Type": "application/strategic-merge-patch+json"})
        if resp.status_code != 200:
            raise ClusterError(f"moving node {name} to address {address}: {resp.status_code} {resp.text}")
        self.progress(f"node {name} moved to {address} (its previous address slot was taken)")

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, t: type[BaseException] | None, v: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()

    # -- components ---------------------------------------------------------------
    def _log(self, name: str) -> Path:
        return self.directory / "logs" / f"{name}.log"

    def _spawn(self, name: str, args: list[str]) -> _Component:
        log = self._log(name)
        with open(log, "ab") as out:
            # A new session per component: Ctrl-C in the terminal reaches us, and we stop them in order.
            proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True)
        component = _Component(name, args, proc, log)
        self._components.append(component)
        self.progress(f"started {name} (pid {proc.pid}, log {log})")
        return component

    def _check_alive(self) -> None:
        for c in self._components:
            if c.process is not None and c.process.poll() is not None:
                tail = c.log.read_text(errors="replace")[-2000:] if c.log else ""
                raise ClusterError(f"{c.name} exited with {c.process.returncode}; log {c.log}:\n{tail}")

    def _wait(self, what: str, probe: Any, deadline: float) -> None:
        while True:
            self._check_alive()
            with contextlib.suppress(httpx.HTTPError, OSError):
                if probe():
                    return
            if time.monotonic() > deadline:
                raise ClusterError(f"timed out waiting for {what}; logs in {self.directory / 'logs'}\n"
                                   + self._log_tails())
            time.sleep(0.2)

    def _log_tails(self, lines: int = 8) -> str:
        """The last lines of each component's log, for an error a CI run can be triaged from."""
        out = []
        for c in self._components:
            if c.log and c.log.is_file():
                tail = c.log.read_text(errors="replace").splitlines()[-lines:]
                out.append(f"--- {c.name} ---\n" + "\n".join(line[:300] for line in tail))
        return "\n".join(out)

    def _start_etcd(self, binary: Path, deadline: float) -> None:
        client, peer = free_port(), free_port()
        self.etcd_url = f"http://127.0.0.1:{client}"
        self._spawn("etcd", [
            str(binary), "--name=default", f"--data-dir={self.directory / 'etcd'}",
            f"--listen-client-urls={self.etcd_url}", f"--advertise-client-urls={self.etcd_url}",
            f"--listen-peer-urls=http://127.0.0.1:{peer}", f"--initial-advertise-peer-urls=http://127.0.0.1:{peer}",
            f"--initial-cluster=default=http://127.0.0.1:{peer}",
            # A throwaway cluster: durability is not worth the fsync latency.
            "--unsafe-no-fsync", "--log-level=warn",
        ])
        self._wait("etcd", lambda: httpx.get(f"{self.etcd_url}/health", timeout=2).json().get("health") == "true",
                   deadline)

    def _start_apiserver(self, binary: Path, deadline: float) -> None:
        self.apiserver_port = free_port()
        p = self.pki
        self._spawn("kube-apiserver", [
            str(binary), f"--etcd-servers={self.etcd_url}",
            "--bind-address=127.0.0.1", "--advertise-address=127.0.0.1", f"--secure-port={self.apiserver_port}",
            f"--cert-dir={self.directory / 'pki'}",
            f"--tls-cert-file={p.serving_cert}", f"--tls-private-key-file={p.serving_key}",
            f"--client-ca-file={p.ca_cert}",
            f"--service-account-key-file={p.sa_pub}", f"--service-account-signing-key-file={p.sa_key}",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
            "--authorization-mode=RBAC", "--allow-privileged=true",
            # Loopback cannot be a Service endpoint; nothing in-cluster dials the apiserver Service here.
            "--endpoint-reconciler-type=none",
            "--profiling=false",
        ])

        def ready() -> bool:
            with self.api() as api:
                return api.get("/readyz").status_code == 200

        self._wait("kube-apiserver /readyz", ready, deadline)

    def _write_kubeconfig(self) -> None:
        config = {
            "apiVersion": "v1", "kind": "Config", "current-context": "daybreak-local", "preferences": {},
            "clusters": [{"name": "daybreak-local", "cluster": {
                "server": self.server, "certificate-authority": str(self.pki.ca_cert)}}],
            "users": [{"name": "daybreak-admin", "user": {
                "client-certificate": str(self.pki.admin_cert), "client-key": str(self.pki.admin_key)}}],
            "contexts": [{"name": "daybreak-local", "context": {
                "cluster": "daybreak-local", "user": "daybreak-admin", "namespace": "default"}}],
        }
        # JSON is valid YAML, and every kubeconfig reader accepts it.
        self.kubeconfig.write_text(json.dumps(config, indent=2))

    def _start_controllers(self, binaries: dict[str, Path], deadline: float) -> None:
        kc = str(self.kubeconfig)
        common = [f"--kubeconfig={kc}", f"--authentication-kubeconfig={kc}", f"--authorization-kubeconfig={kc}",
                  "--bind-address=127.0.0.1", "--leader-elect=false"]
        self._spawn("kube-controller-manager", [
            str(binaries["kube-controller-manager"]), *common, f"--secure-port={free_port()}",
            f"--service-account-private-key-file={self.pki.sa_key}", f"--root-ca-file={self.pki.ca_cert}",
            f"--cluster-signing-cert-file={self.pki.ca_cert}", f"--cluster-signing-key-file={self.pki.ca_key}",
            "--use-service-account-credentials=false", f"--service-cluster-ip-range={SERVICE_CIDR}",
        ])
        self._spawn("kube-scheduler", [str(binaries["kube-scheduler"]), *common, f"--secure-port={free_port()}"])

        def default_sa() -> bool:
            with self.api() as api:
                return api.get("/api/v1/namespaces/default/serviceaccounts/default").status_code == 200

        # Pods are admitted only once the ServiceAccount controller made the default account.
        self._wait("the controller-manager (default ServiceAccount)", default_sa, deadline)

    def _kwok_stages(self) -> list[Path]:
        """kwok's stages; with the process kubelet, its Pod stages skip the pods that kubelet runs."""
        stages = sorted(tools.share_dir("kwok").glob("*.yaml"))
        if not self.spec.process_kubelet:
            return stages
        out_dir = self.directory / "kwok-stages"
        out_dir.mkdir(exist_ok=True)
        out = []
        for stage in stages:
            doc = yaml.safe_load(stage.read_text())
            if ((doc.get("spec") or {}).get("resourceRef") or {}).get("kind") == "Pod":
                selector = doc["spec"].setdefault("selector", {})
                selector.setdefault("matchExpressions", []).extend(dict(e) for e in kubelet_mod.KWOK_EXCLUSIONS)
            target = out_dir / stage.name
            target.write_text(yaml.safe_dump(doc, sort_keys=False))
            out.append(target)
        return out

    def _start_kwok(self, binary: Path) -> None:
        # kwok's own pods keep addresses outside 127/8: loopback addresses cannot be EndpointSlice IPs.
        self._spawn("kwok", [
            str(binary), f"--kubeconfig={self.kubeconfig}",
            "--manage-all-nodes=false", f"--manage-nodes-with-annotation-selector={FAKE_NODE_ANNOTATION}=fake",
            f"--server-address=127.0.0.1:{free_port()}", "--node-ip=10.0.1.1", "--cidr=10.0.2.0/24",
            "--node-lease-duration-seconds=40",
            *(f"--config={stage}" for stage in self._kwok_stages()),
        ])


def fake_node(name: str, spec: ClusterSpec, *, address: str | None = None) -> dict[str, Any]:
    """A kwok-managed Node with fake accelerator capacity and labels (and ``address`` as its InternalIP)."""
    capacity: dict[str, str] = {"cpu": "64", "memory": "512Gi", "pods": "110", "ephemeral-storage": "1Ti"}
    labels = {
        "kubernetes.io/hostname": name, "kubernetes.io/os": "linux", "kubernetes.io/arch": "amd64",
        "type": "kwok", vocab.ACCELERATOR: "none",
    }
    if spec.devices_per_node > 0:
        capacity[ACCELERATOR_RESOURCE[spec.accelerator]] = str(spec.devices_per_node)
        labels[vocab.ACCELERATOR] = spec.accelerator
        labels[vocab.ACCELERATOR_COUNT] = str(spec.devices_per_node)
    return {
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": name, "labels": labels, "annotations": {FAKE_NODE_ANNOTATION: "fake"}},
        "spec": {},
        "status": {"capacity": capacity, "allocatable": capacity, "phase": "Running",
                   **({"addresses": [{"type": "InternalIP", "address": address},
                                     {"type": "Hostname", "address": name}]} if address else {}),
                   "nodeInfo": {"architecture": "amd64", "operatingSystem": "linux", "kubeletVersion": "fake",
                                "kubeProxyVersion": "fake", "containerRuntimeVersion": "kwok",
                                "kernelVersion": "", "osImage": "", "bootID": "", "machineID": "",
                                "systemUUID": ""}},
    }


def spec_dict(spec: ClusterSpec) -> dict[str, Any]:
    return asdict(spec)
