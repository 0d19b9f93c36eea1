"""The process kubelet: pods on the local cluster's fake nodes whose containers run ``daybreak`` become real processes.

kwok keeps playing the kubelet for every other pod (its pod stages are given a
selector that skips these, see ``KWOK_EXCLUSIONS``). Which pods are ours is
one table, ``PROCESS_COMMANDS``, from which both kwok's selector and
``is_process_pod`` are derived: a container whose command is ``daybreak ...``
(agents, sim engines, routers, the operator) or ``python3 -m
vllm.entrypoints.openai.api_server ...`` (vLLM engine pods; run with the
interpreter of the vLLM environment, ``vllm_python`` or
``daybreak.devenv.vllmenv.find()``). For such a pod this kubelet, watching
pods through the API with the admin credentials:

- gives the pod its own loopback address and writes phase, conditions, IPs
  and container statuses through the status subresource. Each cluster claims
  one ``AddressSlot`` X of 127.0.0.0/8 (a lock file, so clusters of several
  users or test sessions on one machine never share an address): fake node i
  is 127.X.0.(i+1), pods get 127.X.1.1 and up, a hostNetwork pod its node's;
- starts each container's command (``daybreak`` is the venv's script next to
  ``sys.executable``; ``python3 -m vllm...`` the vLLM environment's
  interpreter, with ``VLLM_HOST_IP`` the pod's address as a container's own
  network would make it) with its args and env resolved like a kubelet does
  (``$(VAR)``, downward-API fieldRefs, Secret and ConfigMap refs), a per-pod
  ``KUBECONFIG`` holding a TokenRequest token of the pod's ServiceAccount, and
  ``DAYBREAK_SHM_DIR`` set to its node's own shared-memory directory;
- materialises volumes (configMap, secret, downwardAPI, projected, emptyDir)
  under the pod directory and maps hostPaths per node; since a process cannot
  get a mount namespace here, mount paths are rewritten to those directories
  in the command line, env values and the projected files' text;
- runs httpGet/tcpSocket/exec startup, readiness and liveness probes, restarts
  per restartPolicy with back-off (restartCount in status), and on deletion
  sends SIGTERM, waits the grace period, SIGKILLs and deletes the pod with
  grace 0;
- mirrors its pods' readiness into EndpointSlices of addressType FQDN: the API
  server refuses loopback addresses in IPv4 slices, so the endpointslice
  controller cannot publish these pods (see docs/development.md).

Logs land in ``<cluster>/pods/<namespace>_<pod>/<container>.log``. EVERY
PROCESS RUNS IN ITS OWN PROCESS GROUP so stopping a pod, or the cluster, takes
its children with it.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import ipaddress
import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

from daybreak.errors import DaybreakError

log = logging.getLogger(__name__)

DAYBREAK_COMMAND = "daybreak"
VLLM_MODULE = "vllm.entrypoints.openai.api_server"
SLOT_LOCK_DIR = Path(tempfile.gettempdir()) / "daybreak-loopback"
MANAGER = "process-kubelet.daybreak.dev"
SLICE_SUFFIX = "local"


@dataclass(frozen=True)
class ProcessCommand:
    """A container command the process kubelet runs: word ``index`` of ``command`` is exactly ``word``."""

    index: int
    word: str

    def matches(self, command: list[str]) -> bool:
        return len(command) > self.index and command[self.index] == self.word


# THE ONE DEFINITION of which pods are ours: kwok's selector and is_process_pod are both derived from it.
# Exact words, because kwok's NotIn compares strings (no paths, no globs).
DAYBREAK = ProcessCommand(0, DAYBREAK_COMMAND)
VLLM = ProcessCommand(2, VLLM_MODULE)  # python3 -m vllm.entrypoints.openai.api_server ...
PROCESS_COMMANDS = (DAYBREAK, VLLM)
# kwok's pod stages skip a pod when some container matches one of them: its expressions are ANDed, and NotIn
# holds when no element of the query's result is in the set (a missing word is null, which is not).
KWOK_EXCLUSIONS = [{"key": f".spec.containers.[].command.[{c.index}]", "operator": "NotIn", "values": [c.word]}
                   for c in PROCESS_COMMANDS]
# The interpreters a vLLM container's `python3 -m` may name (the image's; the kubelet substitutes its own).
VLLM_INTERPRETERS = ("python3", "python")
TICK_SECONDS = 0.2
# Crash-loop back-off: shorter than a real kubelet's 10 s .. 5 min, so tests see restarts within seconds.
BACKOFF_INITIAL_SECONDS = 1.0
BACKOFF_MAX_SECONDS = 30.0
BACKOFF_RESET_SECONDS = 60.0
STOP_GRACE_SECONDS = 5.0
TOKEN_SECONDS = 24 * 3600
# hostPaths that are the machine's own and shared by every fake node; any other is kept per node
# (/sys is the node's own fake tree, /dev/shm its own shared-memory directory).
HOST_SHARED_PATHS = ("/proc", "/dev/infiniband", "/dev/hugepages", "/dev/null")
# PCI ids a fake node's sysfs shows for its accelerators (class, vendor, device), as discovery reads them.
FAKE_PCI = {"sunrise": (0x120000, 0x1F36, 0x0001), "nvidia": (0x030200, 0x10DE, 0x2330)}

ApiFactory = Callable[[], httpx.Client]


def is_process_pod(pod: dict[str, Any]) -> bool:
    """True when some container's command matches ``PROCESS_COMMANDS`` (exactly what ``KWOK_EXCLUSIONS`` skips)."""
    for c in (pod.get("spec") or {}).get("containers") or []:
        command = [str(x) for x in c.get("command") or []]
        if any(rule.matches(command) for rule in PROCESS_COMMANDS):
            return True
    return False


def cluster_id(directory: Path) -> str:
    """A short stable id of a cluster directory (names its /dev/shm directory)."""
    return hashlib.sha256(str(directory.resolve()).encode()).hexdigest()[:10]


def shm_root(directory: Path) -> Path:
    """Where this cluster's fake nodes keep their shared memory: one sub-directory per node."""
    return Path("/dev/shm") / f"daybreak-{cluster_id(directory)}"


@dataclass
class AddressSlot:
    """One cluster's share of 127.0.0.0/8: 127.X.0.0/16, held through an flock on a file while the cluster runs.

    The lock dies with its process, so a crashed cluster's slot is free again at once (its file stays, to be
    locked again); a cluster stopped cleanly removes its file.
    """

    index: int
    fd: int = -1

    @property
    def path(self) -> Path:
        return SLOT_LOCK_DIR / f"{self.index}.lock"

    @property
    def network(self) -> ipaddress.IPv4Network:
        return ipaddress.IPv4Network(f"127.{self.index}.0.0/16")

    @property
    def node_prefix(self) -> str:
        return f"127.{self.index}.0."

    def node_address(self, index: int) -> str:
        """The loopback address of fake node ``index`` (0-based)."""
        if not 0 <= index < 254:
            raise ValueError(f"fake node index {index} out of range 0..253")
        return f"{self.node_prefix}{index + 1}"

    def release(self) -> None:
        if self.fd >= 0:
            # Unlinked while still locked: whoever opened the file meanwhile finds it gone once it gets the
            # lock (``still_linked``) and moves on, so no two clusters hold one slot.
            with contextlib.suppress(OSError):
                os.unlink(self.path)
            os.close(self.fd)
            self.fd = -1


def still_linked(fd: int, path: Path) -> bool:
    """Whether the file locked through ``fd`` is still the one at ``path`` (not unlinked by a releasing holder)."""
    try:
        return os.path.samestat(os.fstat(fd), os.stat(path))
    except FileNotFoundError:
        return False


def claim_slot(directory: Path) -> AddressSlot:
    """A free slot, trying first the one the cluster directory hashes to (so a cluster usually keeps its addresses)."""
    import fcntl

    SLOT_LOCK_DIR.mkdir(mode=0o1777, parents=True, exist_ok=True)
    start = int(cluster_id(directory), 16) % 254
    for i in range(254):
        index = (start + i) % 254 + 1  # 1..254: 127.0.x.x stays the control plane's
        path = SLOT_LOCK_DIR / f"{index}.lock"
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            continue
        if not still_linked(fd, path):
            os.close(fd)
            continue
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()} {directory}\n".encode())
        return AddressSlot(index, fd)
    raise RuntimeError(f"all 254 loopback address slots are taken (locks in {SLOT_LOCK_DIR}); stop a local cluster")


def node_dir(directory: Path, node: str) -> Path:
    """A fake node's own files (its sysfs, its hostPaths) under the cluster directory."""
    return directory / "nodes" / node


def write_fake_sysfs(root: Path, *, accelerator: str, count: int) -> None:
    """A minimal ``/sys`` showing ``count`` accelerators, so a real agent on a fake node discovers (and labels
    the node with) what the node advertises instead of the machine's own devices."""
    pci_class, vendor, device = FAKE_PCI[accelerator]
    devices = root / "devices" / "pci0000:00"
    links = root / "bus" / "pci" / "devices"
    devices.mkdir(parents=True, exist_ok=True)
    links.mkdir(parents=True, exist_ok=True)
    for i in range(count):
        bdf = f"0000:{i + 1:02x}:00.0"
        fn = devices / bdf
        fn.mkdir(exist_ok=True)
        for name, value in (("class", f"0x{pci_class:06x}"), ("vendor", f"0x{vendor:04x}"),
                            ("device", f"0x{device:04x}"), ("numa_node", "0")):
            (fn / name).write_text(value + "\n")
        link = links / bdf
        if not link.is_symlink():
            link.symlink_to(f"../../../devices/pci0000:00/{bdf}")


def pod_dir_name(namespace: str, name: str) -> str:
    return f"{namespace}_{name}"


def now_iso() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


# -- env and paths ------------------------------------------------------------------------------
_VAR_REF = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' ``$(VAR)`` expansion: defined variables are substituted, ``$$`` escapes, others stay as written."""

    def sub(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        name = m.group(1)
        return env[name] if name in env else m.group(0)

    return _VAR_REF.sub(sub, text)


def rewrite_paths(text: str, mounts: list[tuple[str, str]]) -> str:
    """Replace each mount path (on path boundaries) by the host directory standing in for it.

    ``mounts`` are ``(mountPath, host path)``; the longest mount path wins.
    """
    # One pass over the text: a host path already put in (under /tmp, say) must not be rewritten again
    # by a shorter mount path such as an emptyDir at /tmp.
    hosts: dict[str, str] = {}
    for mount_path, host in mounts:
        mp = mount_path.rstrip("/") or "/"
        if mp != "/":
            hosts[mp] = host
    if not hosts:
        return text
    alternatives = "|".join(re.escape(mp) for mp in sorted(hosts, key=len, reverse=True))
    pattern = re.compile(r"(?<![\w./-])(" + alternatives + r")(?=$|[/\s\"',:;=)\]}])")
    return pattern.sub(lambda m: hosts[m.group(1)], text)


def field_ref(pod: dict[str, Any], path: str) -> str:
    """The value of a downward-API ``fieldRef.fieldPath``."""
    meta, spec, status = pod.get("metadata") or {}, pod.get("spec") or {}, pod.get("status") or {}
    m = re.fullmatch(r"metadata\.(labels|annotations)\['(.+)'\]", path)
    if m:
        return str((meta.get(m.group(1)) or {}).get(m.group(2), ""))
    simple = {
        "metadata.name": meta.get("name"), "metadata.namespace": meta.get("namespace"),
        "metadata.uid": meta.get("uid"), "spec.nodeName": spec.get("nodeName"),
        "spec.serviceAccountName": spec.get("serviceAccountName") or "default",
        "status.podIP": status.get("podIP"), "status.hostIP": status.get("hostIP"),
        "status.podIPs": ",".join(i["ip"] for i in status.get("podIPs") or []),
        "status.hostIPs": ",".join(i["ip"] for i in status.get("hostIPs") or []),
    }
    if path in ("metadata.labels", "metadata.annotations"):
        items = meta.get(path.split(".")[1]) or {}
        return "\n".join(f'{k}="{v}"' for k, v in sorted(items.items()))
    if path not in simple:
        raise ValueError(f"fieldRef {path!r} is not supported by the process kubelet")
    return str(simple[path] or "")


# -- probes -----------------------------------------------------------------------------------
@dataclass
class ProbeState:
    """One probe of one container: when it runs next and its consecutive results."""

    spec: dict[str, Any]
    started_at: float
    next_at: float = 0.0
    successes: int = 0
    failures: int = 0
    result: bool | None = None

    def __post_init__(self) -> None:
        self.next_at = self.started_at + float(self.spec.get("initialDelaySeconds") or 0)

    def due(self, now: float) -> bool:
        return now >= self.next_at

    def record(self, ok: bool, now: float) -> None:
        self.next_at = now + float(self.spec.get("periodSeconds") or 10)
        if ok:
            self.successes, self.failures = self.successes + 1, 0
            if self.successes >= int(self.spec.get("successThreshold") or 1):
                self.result = True
        else:
            self.failures, self.successes = self.failures + 1, 0
            if self.failures >= int(self.spec.get("failureThreshold") or 3):
                self.result = False


def resolve_port(port: Any, container: dict[str, Any]) -> int:
    if isinstance(port, int) or (isinstance(port, str) and port.isdigit()):
        return int(port)
    for p in container.get("ports") or []:
        if p.get("name") == port:
            return int(p["containerPort"])
    raise ValueError(f"port {port!r} is not a port of container {container.get('name')!r}")


def run_probe(spec: dict[str, Any], *, container: dict[str, Any], host: str, env: dict[str, str],
              cwd: Path) -> bool:
    """One probe attempt: httpGet (2xx/3xx), tcpSocket (connects) or exec (exit 0)."""
    timeout = float(spec.get("timeoutSeconds") or 1)
    try:
        if "httpGet" in spec:
            h = spec["httpGet"]
            port = resolve_port(h.get("port"), container)
            target = h.get("host") or host
            scheme = str(h.get("scheme") or "HTTP").lower()
            headers = {x["name"]: x["value"] for x in h.get("httpHeaders") or []}
            resp = httpx.get(f"{scheme}://{target}:{port}{h.get('path') or '/'}", headers=headers,
                             timeout=timeout, verify=False)
            return 200 <= resp.status_code < 400
        if "tcpSocket" in spec:
            t = spec["tcpSocket"]
            port = resolve_port(t.get("port"), container)
            with socket.create_connection((t.get("host") or host, port), timeout=timeout):
                return True
        if "exec" in spec:
            proc = subprocess.run(spec["exec"].get("command") or ["false"], env=env, cwd=cwd,
                                  capture_output=True, timeout=timeout, check=False)
            return proc.returncode == 0
    except (OSError, httpx.HTTPError, subprocess.TimeoutExpired, ValueError):
        return False
    log.warning("event=probe_unsupported probe=%s (treated as passing)", sorted(spec))
    return True


# -- containers -----------------------------------------------------------------------------------
@dataclass
class ContainerRun:
    """What the kubelet knows about one container of one pod across its restarts."""

    spec: dict[str, Any]
    process: subprocess.Popen[bytes] | None = None
    started_at: float = 0.0
    started_iso: str = ""
    restart_count: int = 0
    runs: int = 0
    backoff: float = 0.0
    not_before: float = 0.0
    last_terminated: dict[str, Any] | None = None
    waiting_reason: str = "ContainerCreating"
    waiting_message: str = ""
    startup: ProbeState | None = None
    readiness: ProbeState | None = None
    liveness: ProbeState | None = None
    started: bool = False
    ready: bool = False
    finished: bool = False  # terminated for good (restartPolicy says no more)

    @property
    def name(self) -> str:
        return str(self.spec["name"])

    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def state(self) -> dict[str, Any]:
        if self.running():
            return {"running": {"startedAt": self.started_iso}}
        if (self.finished or self.waiting_reason == "") and self.last_terminated:
            return {"terminated": self.last_terminated}
        waiting: dict[str, Any] = {"reason": self.waiting_reason or "ContainerCreating"}
        if self.waiting_message:
            waiting["message"] = self.waiting_message[:1000]
        return {"waiting": waiting}

    def status(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "name": self.name, "image": self.spec.get("image") or "daybreak", "imageID": "",
            "ready": self.ready, "started": self.started and self.running(),
            "restartCount": self.restart_count, "state": self.state(), "lastState": {},
        }
        if self.process is not None:
            out["containerID"] = f"process://{self.process.pid}"
        if self.last_terminated and "terminated" not in out["state"]:
            out["lastState"] = {"terminated": self.last_terminated}
        return out


def signal_group(proc: subprocess.Popen[bytes], sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)


def terminate(proc: subprocess.Popen[bytes], *, grace: float) -> int:
    """SIGTERM the process group, SIGKILL it after ``grace`` seconds; returns the exit code."""
    if proc.poll() is None:
        signal_group(proc, signal.SIGTERM)
        try:
            proc.wait(timeout=max(grace, 0.0))
        except subprocess.TimeoutExpired:
            signal_group(proc, signal.SIGKILL)
            proc.wait()
    # Children the main process left behind go with its group.
    signal_group(proc, signal.SIGKILL)
    return int(proc.returncode)


# -- the API ---------------------------------------------------------------------------------------
class ApiError(DaybreakError, RuntimeError):
    """An API call the kubelet could not make; retried by the caller's loop."""


def _check(resp: httpx.Response, what: str, *, ok: tuple[int, ...] = (200, 201)) -> dict[str, Any]:
    if resp.status_code not in ok:
        raise ApiError(f"{what}: {resp.status_code} {resp.text[:500]}")
    return dict(resp.json()) if resp.content else {}


# -- one pod -----------------------------------------------------------------------------------
class PodWorker(threading.Thread):
    """Runs one pod's containers until the pod is deleted; the only writer of that pod's status."""

    def __init__(self, kubelet: ProcessKubelet, pod: dict[str, Any]) -> None:
        meta = pod["metadata"]
        super().__init__(name=f"pod-{meta['namespace']}/{meta['name']}", daemon=True)
        self.kubelet = kubelet
        self.pod = pod
        self.uid = str(meta["uid"])
        self.namespace = str(meta["namespace"])
        self.pod_name = str(meta["name"])
        self.node = str(pod["spec"]["nodeName"])
        self.dir = kubelet.pods_dir / pod_dir_name(self.namespace, self.pod_name)
        self.gone = threading.Event()  # the API object is gone (force-deleted or we deleted it)
        self.stopping = threading.Event()  # the cluster is stopping
        self.lock = threading.Lock()
        self.containers = [ContainerRun(spec=c) for c in pod["spec"].get("containers") or []]
        self.pod_ip = ""
        self.host_ip = ""
        self.start_iso = now_iso()
        self.conditions: dict[str, dict[str, Any]] = {}
        self.last_status: dict[str, Any] | None = None
        self.mounts: list[tuple[str, str]] = []
        self.prepared = False
        self.prepare_error = ""
        self.terminating = False
        self.patch_not_before = 0.0  # after a failed status patch: retry, but not every tick

    # called from the watch thread
    def update(self, pod: dict[str, Any]) -> None:
        with self.lock:
            self.pod = pod

    def current(self) -> dict[str, Any]:
        with self.lock:
            return self.pod

    # -- the loop ---------------------------------------------------------------------------
    def run(self) -> None:
        api = self.kubelet.api_factory()
        try:
            self._loop(api)
        except Exception:  # a bug must not leave processes behind
            log.exception("event=pod_worker_crashed pod=%s/%s", self.namespace, self.pod_name)
        finally:
            self._kill_all(grace=STOP_GRACE_SECONDS if not self.gone.is_set() else 1.0)
            shutil.rmtree(self.kubelet.shm_root / f".ipc-{self.uid[:12]}", ignore_errors=True)
            self.kubelet.forget(self)
            api.close()

    def _loop(self, api: httpx.Client) -> None:
        while not self.stopping.is_set() and not self.gone.is_set():
            pod = self.current()
            if (pod.get("metadata") or {}).get("deletionTimestamp"):
                self._delete_gracefully(api, pod)
                return
            if not self.prepared:
                self._prepare(api, pod)
            if self.prepared:
                for c in self.containers:
                    self._supervise(api, pod, c)
            self._publish(api, pod)
            self.stopping.wait(TICK_SECONDS)

    def _prepare(self, api: httpx.Client, pod: dict[str, Any]) -> None:
        """IP, directories, kubeconfig and volumes; retried every tick until it succeeds."""
        try:
            if pod["spec"].get("initContainers"):
                raise ValueError("init containers are not supported by the process kubelet")
            node_ip = self.kubelet.node_ip(api, self.node)
            self.host_ip = node_ip
            self.pod_ip = node_ip if pod["spec"].get("hostNetwork") else self.kubelet.allocate_ip(
                self.uid, previous=str((pod.get("status") or {}).get("podIP") or ""))
            self.dir.mkdir(parents=True, exist_ok=True)
            (self.dir / "tmp").mkdir(exist_ok=True)
            self._write_kubeconfig(api, pod)
            self.mounts = self._materialise_volumes(api, pod)
        except (ApiError, httpx.HTTPError, OSError, ValueError, KeyError) as exc:
            self.prepare_error = str(exc)
            for c in self.containers:
                c.waiting_reason, c.waiting_message = "ContainerCreating", str(exc)
            return
        self.prepare_error = ""
        self.prepared = True

    # -- credentials and volumes ---------------------------------------------------------------
    def _automount(self, api: httpx.Client, pod: dict[str, Any]) -> bool:
        spec = pod["spec"]
        if spec.get("automountServiceAccountToken") is not None:
            return bool(spec["automountServiceAccountToken"])
        sa = self._service_account(pod)
        resp = api.get(f"/api/v1/namespaces/{self.namespace}/serviceaccounts/{sa}")
        obj = _check(resp, f"ServiceAccount {self.namespace}/{sa}")
        return obj.get("automountServiceAccountToken") is not False

    @staticmethod
    def _service_account(pod: dict[str, Any]) -> str:
        return str(pod["spec"].get("serviceAccountName") or "default")

    def token(self, api: httpx.Client, pod: dict[str, Any], *, audiences: list[str] | None = None,
              seconds: int = TOKEN_SECONDS) -> str:
        """A TokenRequest token of the pod's ServiceAccount, bound to the pod (invalid once it is deleted)."""
        sa = self._service_account(pod)
        body = {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
                "spec": {"audiences": audiences or [], "expirationSeconds": seconds,
                         "boundObjectRef": {"apiVersion": "v1", "kind": "Pod", "name": self.pod_name,
                                            "uid": self.uid}}}
        resp = api.post(f"/api/v1/namespaces/{self.namespace}/serviceaccounts/{sa}/token", json=body)
        return str(_check(resp, f"token for ServiceAccount {self.namespace}/{sa}")["status"]["token"])

    @property
    def kubeconfig(self) -> Path:
        return self.dir / "kubeconfig"

    def _write_kubeconfig(self, api: httpx.Client, pod: dict[str, Any]) -> None:
        if not self._automount(api, pod):
            self.kubeconfig.unlink(missing_ok=True)
            return
        token = self.token(api, pod)
        config = {
            "apiVersion": "v1", "kind": "Config", "current-context": "pod", "preferences": {},
            "clusters": [{"name": "local", "cluster": {"server": self.kubelet.server,
                                                       "certificate-authority": str(self.kubelet.ca_cert)}}],
            "users": [{"name": self._service_account(pod), "user": {"token": token}}],
            "contexts": [{"name": "pod", "context": {"cluster": "local", "user": self._service_account(pod),
                                                     "namespace": self.namespace}}],
        }
        fd = os.open(self.kubeconfig, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(config, f, indent=2)

    def _host_path(self, path: str) -> Path:
        """Where a hostPath lives for this pod's fake node."""
        clean = "/" + path.strip("/")
        if clean == "/dev/shm" or clean.startswith("/dev/shm/"):
            return self.kubelet.node_shm_dir(self.node) / clean.removeprefix("/dev/shm").lstrip("/")
        if clean == "/sys" or clean.startswith("/sys/"):
            return node_dir(self.kubelet.directory, self.node) / clean.lstrip("/")
        if any(clean == p or clean.startswith(p + "/") for p in HOST_SHARED_PATHS):
            return Path(clean)
        # Anything else (an SSD tier's directory, say) is the node's own: kept apart per fake node.
        return node_dir(self.kubelet.directory, self.node) / "root" / clean.lstrip("/")

    def _key_values(self, api: httpx.Client, kind: str, name: str, *, optional: bool) -> dict[str, bytes]:
        path = "secrets" if kind == "Secret" else "configmaps"
        resp = api.get(f"/api/v1/namespaces/{self.namespace}/{path}/{name}")
        if resp.status_code == 404 and optional:
            return {}
        obj = _check(resp, f"{kind} {self.namespace}/{name}")
        if kind == "Secret":
            return {k: base64.b64decode(v) for k, v in (obj.get("data") or {}).items()}
        out = {k: str(v).encode() for k, v in (obj.get("data") or {}).items()}
        out.update({k: base64.b64decode(v) for k, v in (obj.get("binaryData") or {}).items()})
        return out

    def _project(self, api: httpx.Client, pod: dict[str, Any], source: dict[str, Any]) -> dict[str, bytes]:
        """The files one volume (or projected source) holds: relative path -> bytes."""
        for kind, key in (("ConfigMap", "configMap"), ("Secret", "secret")):
            if key in source:
                ref = source[key]
                name = ref.get("name") or ref.get("secretName") or ""
                data = self._key_values(api, kind, name, optional=bool(ref.get("optional")))
                items = ref.get("items")
                if not items:
                    return data
                return {i["path"]: data[i["key"]] for i in items if i["key"] in data}
        if "downwardAPI" in source:
            out: dict[str, bytes] = {}
            for item in source["downwardAPI"].get("items") or []:
                if "fieldRef" in item:
                    out[item["path"]] = field_ref(self.with_addresses(pod), item["fieldRef"]["fieldPath"]).encode()
            return out
        if "serviceAccountToken" in source:
            t = source["serviceAccountToken"]
            audience = [t["audience"]] if t.get("audience") else None
            seconds = max(int(t.get("expirationSeconds") or 3600), 600)
            return {t["path"]: self.token(api, pod, audiences=audience, seconds=seconds).encode()}
        return {}

    def _materialise_volumes(self, api: httpx.Client, pod: dict[str, Any]) -> list[tuple[str, str]]:
        volumes_dir = self.dir / "volumes"
        where: dict[str, Path] = {}
        files: dict[str, dict[str, bytes]] = {}
        for vol in pod["spec"].get("volumes") or []:
            name = vol["name"]
            if "hostPath" in vol:
                host = self._host_path(vol["hostPath"]["path"])
                if vol["hostPath"].get("type") in ("DirectoryOrCreate", "Directory") or str(host).startswith(
                        str(self.kubelet.directory)) or str(host).startswith(str(self.kubelet.shm_root)):
                    with contextlib.suppress(OSError):
                        host.mkdir(parents=True, exist_ok=True)
                where[name] = host
                continue
            target = volumes_dir / name
            target.mkdir(parents=True, exist_ok=True)
            where[name] = target
            if "projected" in vol:
                merged: dict[str, bytes] = {}
                for src in vol["projected"].get("sources") or []:
                    merged.update(self._project(api, pod, src))
                files[name] = merged
            else:
                files[name] = self._project(api, pod, vol)
        mounts: list[tuple[str, str]] = []
        for c in pod["spec"].get("containers") or []:
            for m in c.get("volumeMounts") or []:
                base = where.get(m["name"])
                if base is None:
                    raise ValueError(f"container {c['name']!r} mounts unknown volume {m['name']!r}")
                host = base / m["subPath"] if m.get("subPath") else base
                mounts.append((str(m["mountPath"]), str(host)))
        # Write the files last: their text gets the same mount-path rewriting as the command line.
        for name, content in files.items():
            for rel, data in content.items():
                path = where[name] / rel
                path.parent.mkdir(parents=True, exist_ok=True)
                with contextlib.suppress(UnicodeDecodeError):
                    data = rewrite_paths(data.decode(), mounts).encode()
                path.write_bytes(data)
        return mounts

    # -- env --------------------------------------------------------------------------------------
    def with_addresses(self, pod: dict[str, Any]) -> dict[str, Any]:
        """``pod`` as the downward API sees it: with the addresses this kubelet gave it (maybe not published yet)."""
        status = dict(pod.get("status") or {})
        if self.pod_ip:
            status.update(podIP=self.pod_ip, podIPs=[{"ip": self.pod_ip}])
        if self.host_ip:
            status.update(hostIP=self.host_ip, hostIPs=[{"ip": self.host_ip}])
        return {**pod, "status": status}

    def environment(self, api: httpx.Client, pod: dict[str, Any], container: dict[str, Any]) -> dict[str, str]:
        """The process's environment: a minimal base, then the container's envFrom and env, resolved."""
        pod = self.with_addresses(pod)
        venv_bin = str(Path(sys.executable).parent)
        base = {
            "PATH": f"{venv_bin}:{os.environ.get('PATH', '/usr/local/bin:/usr/bin:/bin')}",
            "HOME": str(self.dir), "HOSTNAME": self.pod_name, "TMPDIR": str(self.dir / "tmp"),
            "LANG": "C.UTF-8", "PYTHONUNBUFFERED": "1", "PYTHONSAFEPATH": "1",
            "DAYBREAK_SHM_DIR": str(self.kubelet.node_shm_dir(self.node)),
        }
        if self.kubeconfig.is_file():
            base["KUBECONFIG"] = str(self.kubeconfig)
        env: dict[str, str] = {}
        for src in container.get("envFrom") or []:
            prefix = src.get("prefix") or ""
            for kind, key in (("ConfigMap", "configMapRef"), ("Secret", "secretRef")):
                if key in src:
                    data = self._key_values(api, kind, src[key]["name"], optional=bool(src[key].get("optional")))
                    env.update({prefix + k: v.decode(errors="replace") for k, v in data.items()})
        for item in container.get("env") or []:
            name = item["name"]
            if "value" in item or "valueFrom" not in item:
                env[name] = expand(str(item.get("value") or ""), env)
                continue
            ref = item["valueFrom"]
            if "fieldRef" in ref:
                env[name] = field_ref(pod, ref["fieldRef"]["fieldPath"])
            elif "secretKeyRef" in ref or "configMapKeyRef" in ref:
                kind, key = ("Secret", "secretKeyRef") if "secretKeyRef" in ref else ("ConfigMap", "configMapKeyRef")
                r = ref[key]
                data = self._key_values(api, kind, r["name"], optional=bool(r.get("optional")))
                if r["key"] not in data:
                    if r.get("optional"):
                        continue
                    raise ValueError(f"{kind} {self.namespace}/{r['name']} has no key {r['key']!r}")
                env[name] = data[r["key"]].decode(errors="replace")
            elif "resourceFieldRef" in ref:
                resource = ref["resourceFieldRef"].get("resource", "")
                kind_, _, res = resource.partition(".")
                value = ((container.get("resources") or {}).get(kind_) or {}).get(res)
                env[name] = str(value if value is not None else "0")
        env = {k: rewrite_paths(v, self.mounts) for k, v in env.items()}
        if VLLM.matches([str(x) for x in container.get("command") or []]):
            # A container's own network would give vLLM the pod's address; here the machine has many, and
            # vLLM's message queue would bind the host's. The venv's bin first, as `python3` would be in an image.
            vllm_bin = str(self.kubelet.vllm_interpreter().parent)
            base.update(PATH=f"{vllm_bin}:{base['PATH']}", VLLM_HOST_IP=self.pod_ip,
                        VLLM_RPC_BASE_PATH=str(self.ipc_dir()))
        return {**base, **env}

    def command_line(self, container: dict[str, Any], env: dict[str, str]) -> list[str]:
        command = [expand(x, env) for x in container.get("command") or []]
        args = [expand(x, env) for x in container.get("args") or []]
        if DAYBREAK.matches(command):
            executable = Path(sys.executable).with_name(DAYBREAK_COMMAND)
        elif VLLM.matches(command):
            if command[0] not in VLLM_INTERPRETERS or command[1] != "-m":
                raise ValueError(f"container {container['name']!r}: a vLLM command must start `python3 -m "
                                 f"{VLLM_MODULE}`, got {' '.join(command[:3])!r}")
            executable = self.kubelet.vllm_interpreter()
        else:
            raise ValueError(f"container {container['name']!r} runs neither `{DAYBREAK_COMMAND}` nor `python3 -m "
                             f"{VLLM_MODULE}`; the process kubelet runs only those")
        return [str(executable)] + [rewrite_paths(x, self.mounts) for x in command[1:] + args]

    def ipc_dir(self) -> Path:
        """A short directory for the pod's Unix sockets: vLLM's ZeroMQ ones live under ``VLLM_RPC_BASE_PATH``,
        and a path under the pod directory passes the 107-byte ``sun_path`` limit. Under the cluster's
        shared-memory root, so stopping the cluster (or ``dev down``) removes it with the rest."""
        path = self.kubelet.shm_root / f".ipc-{self.uid[:12]}"
        path.mkdir(parents=True, exist_ok=True)
        return path

    # -- supervision ------------------------------------------------------------------------------
    def _restart_allowed(self, pod: dict[str, Any], exit_code: int) -> bool:
        policy = pod["spec"].get("restartPolicy") or "Always"
        return policy == "Always" or (policy == "OnFailure" and exit_code != 0)

    def _start(self, api: httpx.Client, pod: dict[str, Any], c: ContainerRun) -> None:
        try:
            env = self.environment(api, pod, c.spec)
            argv = self.command_line(c.spec, env)
        except (ApiError, httpx.HTTPError, ValueError, KeyError) as exc:
            c.waiting_reason, c.waiting_message = "CreateContainerConfigError", str(exc)
            c.not_before = time.monotonic() + 2.0
            return
        cwd = Path(rewrite_paths(c.spec["workingDir"], self.mounts)) if c.spec.get("workingDir") else self.dir
        log_path = self.dir / f"{c.name}.log"
        with open(log_path, "ab") as out:
            if c.runs:
                out.write(f"--- process kubelet: restart {c.restart_count} at {now_iso()} ---\n".encode())
                out.flush()
            try:
                c.process = subprocess.Popen(argv, env=env, cwd=cwd, stdout=out, stderr=subprocess.STDOUT,
                                             stdin=subprocess.DEVNULL, start_new_session=True)
            except OSError as exc:
                c.waiting_reason, c.waiting_message = "RunContainerError", str(exc)
                c.not_before = time.monotonic() + 2.0
                return
        self.kubelet.register_process(c.process)
        # For `daybreak dev down` after a supervisor that died without stopping its pods.
        (self.dir / f"{c.name}.pid").write_text(f"{c.process.pid}\n")
        c.runs += 1
        c.started_at, c.started_iso = time.monotonic(), now_iso()
        c.waiting_reason, c.waiting_message = "", ""
        c.started = "startupProbe" not in c.spec
        c.ready = False
        c.startup = ProbeState(c.spec["startupProbe"], c.started_at) if "startupProbe" in c.spec else None
        c.readiness = ProbeState(c.spec["readinessProbe"], c.started_at) if "readinessProbe" in c.spec else None
        c.liveness = ProbeState(c.spec["livenessProbe"], c.started_at) if "livenessProbe" in c.spec else None
        log.info("event=container_started pod=%s/%s container=%s pid=%d ip=%s", self.namespace, self.pod_name,
                 c.name, c.process.pid, self.pod_ip)

    def _exited(self, pod: dict[str, Any], c: ContainerRun, *, reason: str | None = None) -> None:
        assert c.process is not None
        code = int(c.process.returncode if c.process.returncode is not None else -1)
        self.kubelet.unregister_process(c.process)
        (self.dir / f"{c.name}.pid").unlink(missing_ok=True)
        ran = time.monotonic() - c.started_at
        c.last_terminated = {"exitCode": code if code >= 0 else 128 - code,
                             "reason": reason or ("Completed" if code == 0 else "Error"),
                             "startedAt": c.started_iso, "finishedAt": now_iso(),
                             "containerID": f"process://{c.process.pid}"}
        c.process = None
        c.ready = c.started = False
        if self._restart_allowed(pod, code):
            c.backoff = BACKOFF_INITIAL_SECONDS if ran >= BACKOFF_RESET_SECONDS or not c.backoff else min(
                c.backoff * 2, BACKOFF_MAX_SECONDS)
            c.not_before = time.monotonic() + c.backoff
            c.waiting_reason = "CrashLoopBackOff"
            c.waiting_message = f"back-off {c.backoff:.0f}s restarting failed container {c.name}"
            c.restart_count += 1
        else:
            c.finished = True
            c.waiting_reason = ""
        log.info("event=container_exited pod=%s/%s container=%s code=%d restart=%s", self.namespace,
                 self.pod_name, c.name, code, not c.finished)

    def _supervise(self, api: httpx.Client, pod: dict[str, Any], c: ContainerRun) -> None:
        now = time.monotonic()
        if c.process is not None and c.process.poll() is not None:
            self._exited(pod, c)
        if c.process is None:
            if not c.finished and now >= c.not_before:
                self._start(api, pod, c)
            return

        def probe(p: ProbeState) -> bool:
            return run_probe(p.spec, container=c.spec, host=self.pod_ip,
                             env={"PATH": os.environ.get("PATH", "")}, cwd=self.dir)

        if c.startup is not None and not c.started:
            if c.startup.due(now):
                c.startup.record(probe(c.startup), now)
                if c.startup.result is True:
                    c.started = True
                    if c.readiness is not None:
                        c.readiness.next_at = now
                elif c.startup.result is False:
                    self._kill_for_probe(pod, c, "startup")
            return
        if c.liveness is not None and c.liveness.due(now):
            c.liveness.record(probe(c.liveness), now)
            if c.liveness.result is False:
                self._kill_for_probe(pod, c, "liveness")
                return
        if c.readiness is None:
            c.ready = True
        elif c.readiness.due(now):
            c.readiness.record(probe(c.readiness), now)
            c.ready = c.readiness.result is True

    def _kill_for_probe(self, pod: dict[str, Any], c: ContainerRun, which: str) -> None:
        assert c.process is not None
        log.info("event=probe_failed pod=%s/%s container=%s probe=%s action=kill", self.namespace,
                 self.pod_name, c.name, which)
        terminate(c.process, grace=float(self._grace(pod)))
        self._exited(pod, c, reason="Error")

    # -- deletion --------------------------------------------------------------------------------
    def _grace(self, pod: dict[str, Any]) -> int:
        meta, spec = pod.get("metadata") or {}, pod.get("spec") or {}
        value = meta.get("deletionGracePeriodSeconds")
        if value is None:
            value = spec.get("terminationGracePeriodSeconds")
        return int(30 if value is None else value)

    def _delete_gracefully(self, api: httpx.Client, pod: dict[str, Any]) -> None:
        """SIGTERM every container, wait out the grace period, SIGKILL the rest, then delete with grace 0."""
        self.terminating = True
        grace = self._grace(pod)
        deadline = time.monotonic() + grace
        live = [c for c in self.containers if c.running()]
        for c in live:
            assert c.process is not None
            signal_group(c.process, signal.SIGTERM)
        log.info("event=pod_terminating pod=%s/%s grace=%ds", self.namespace, self.pod_name, grace)
        while any(c.running() for c in live) and time.monotonic() < deadline and not self.gone.is_set():
            for c in live:  # readiness goes false at once; EndpointSlices drop the pod
                c.ready = False
            self._publish(api, self.current())
            self.stopping.wait(TICK_SECONDS)
        for c in live:
            if c.process is not None:
                terminate(c.process, grace=0)
                reason = "Completed" if c.process.returncode == 0 else "Error"
                self._exited({"spec": {"restartPolicy": "Never"}}, c, reason=reason)
        self._publish(api, self.current())
        for attempt in range(20):
            with contextlib.suppress(httpx.HTTPError):
                resp = api.request("DELETE", f"/api/v1/namespaces/{self.namespace}/pods/{self.pod_name}",
                                   json={"apiVersion": "v1", "kind": "DeleteOptions", "gracePeriodSeconds": 0,
                                         "preconditions": {"uid": self.uid}})
                if resp.status_code in (200, 202, 404, 409):
                    break
            time.sleep(min(0.2 * (attempt + 1), 2.0))
        self.gone.set()

    def _kill_all(self, *, grace: float) -> None:
        procs = [c.process for c in self.containers if c.process is not None]
        for p in procs:
            signal_group(p, signal.SIGTERM)
        deadline = time.monotonic() + grace
        for p in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=max(deadline - time.monotonic(), 0.0))
            terminate(p, grace=0)
            self.kubelet.unregister_process(p)
        for c in self.containers:
            (self.dir / f"{c.name}.pid").unlink(missing_ok=True)

    # -- status -----------------------------------------------------------------------------------
    def _condition(self, type_: str, ok: bool, reason: str = "") -> dict[str, Any]:
        status = "True" if ok else "False"
        old = self.conditions.get(type_)
        if old is None or old["status"] != status:
            old = {"type": type_, "status": status, "lastProbeTime": None, "lastTransitionTime": now_iso()}
            if reason:
                old["reason"] = reason
            self.conditions[type_] = old
        return old

    def phase(self, pod: dict[str, Any]) -> str:
        if not self.prepared or all(c.runs == 0 for c in self.containers):
            return "Pending"
        if all(c.finished for c in self.containers):
            codes = [int((c.last_terminated or {}).get("exitCode", 1)) for c in self.containers]
            return "Succeeded" if all(code == 0 for code in codes) else "Failed"
        return "Running"

    def status(self, pod: dict[str, Any]) -> dict[str, Any]:
        phase = self.phase(pod)
        ready = phase == "Running" and all(c.ready for c in self.containers) and not self.terminating
        not_ready = "" if ready else ("PodCompleted" if phase in ("Succeeded", "Failed") else "ContainersNotReady")
        status: dict[str, Any] = {
            "phase": phase,
            "conditions": [self._condition("PodReadyToStartContainers", self.prepared),
                           self._condition("Initialized", True),
                           self._condition("ContainersReady", ready, not_ready),
                           self._condition("Ready", ready, not_ready)],
            "containerStatuses": [c.status() for c in self.containers],
            "startTime": self.start_iso,
        }
        if self.host_ip:
            status.update(hostIP=self.host_ip, hostIPs=[{"ip": self.host_ip}])
        if self.pod_ip:
            status.update(podIP=self.pod_ip, podIPs=[{"ip": self.pod_ip}])
        if self.prepare_error:
            status["message"] = self.prepare_error[:500]
        return status

    def _publish(self, api: httpx.Client, pod: dict[str, Any]) -> None:
        status = self.status(pod)
        comparable = json.dumps(status, sort_keys=True)
        if self.last_status is not None and json.dumps(self.last_status, sort_keys=True) == comparable:
            return
        if time.monotonic() < self.patch_not_before:
            return
        self.patch_not_before = time.monotonic() + 1.0  # cleared on success
        try:
            # Strategic merge: conditions merge by type, so PodScheduled (the scheduler's) stays.
            resp = api.patch(f"/api/v1/namespaces/{self.namespace}/pods/{self.pod_name}/status",
                             content=json.dumps({"status": status_patch(status)}),
                             headers={"Content-Type": "application/strategic-merge-patch+json"})
        except httpx.HTTPError as exc:
            log.warning("event=status_patch_failed pod=%s/%s error=%r (retried)", self.namespace, self.pod_name, exc)
            return
        if resp.status_code == 404:
            self.gone.set()
            return
        if resp.status_code != 200:
            log.warning("event=status_patch_failed pod=%s/%s status=%d body=%s (retried)", self.namespace,
                        self.pod_name, resp.status_code, resp.text[:300])
            return
        self.last_status = status
        self.patch_not_before = 0.0
        self.kubelet.endpoints_changed(self.namespace)


def status_patch(status: dict[str, Any]) -> dict[str, Any]:
    """``status`` as a strategic-merge patch that replaces the pod's address lists instead of merging them.

    ``podIPs`` and ``hostIPs`` merge by ``ip``: merged, a pod started again on another address (its cluster
    restarted in another address slot) would hold both, and the API server refuses a second address of
    one family with 422, after which no status of that pod gets through. The address is the kubelet's
    alone, so its list is replaced whole.
    """
    patch = dict(status)
    for key in ("podIPs", "hostIPs"):
        if key in patch:
            patch[key] = [{"$patch": "replace"}, *patch[key]]
    return patch


# -- the kubelet -----------------------------------------------------------------------------------
@dataclass
class ProcessKubelet:
    """Watches pods bound to the cluster's fake nodes and runs the ``daybreak`` ones; start() / stop()."""

    directory: Path
    server: str
    ca_cert: Path
    api_factory: ApiFactory
    slot: AddressSlot
    fake_node_annotation: str = "kwok.x-k8s.io/node"
    progress: Callable[[str], None] = print
    # The interpreter vLLM containers run with; None: the checkout's `make vllm-env`, looked up at each start.
    vllm_python: Path | None = None
    workers: dict[str, PodWorker] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.directory = self.directory.resolve()
        self.pods_dir = self.directory / "pods"
        self.shm_root = shm_root(self.directory)
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._ips: dict[str, str] = {}
        self._next_ip = 0
        self._nodes: dict[str, str] = {}  # node -> address (empty: not a fake node)
        self._extra_node_index = 200
        self._processes: set[subprocess.Popen[bytes]] = set()
        self._done: set[str] = set()  # uids whose worker finished: late events must not start them again
        self._dirty: set[str] = set()
        self._dirty_event = threading.Event()

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self) -> ProcessKubelet:
        self.pods_dir.mkdir(parents=True, exist_ok=True)
        self.shm_root.mkdir(parents=True, exist_ok=True)
        for target, name in ((self._watch_pods, "process-kubelet-watch"),
                             (self._mirror_endpoints, "process-kubelet-endpoints")):
            t = threading.Thread(target=target, name=name, daemon=True)
            t.start()
            self._threads.append(t)
        self.progress(f"started the process kubelet (pods in {self.pods_dir}, shared memory in {self.shm_root})")
        return self

    def stop(self) -> None:
        """Stop every pod's processes (SIGTERM, then SIGKILL), and remove the nodes' shared-memory directories."""
        self._stop.set()
        self._dirty_event.set()
        with self._lock:
            workers = list(self.workers.values())
        for w in workers:
            w.stopping.set()
        for w in workers:
            w.join(timeout=STOP_GRACE_SECONDS + 5)
        for t in self._threads:
            t.join(timeout=10)
        with self._lock:
            leftovers = list(self._processes)
        for p in leftovers:  # a worker that did not finish in time
            terminate(p, grace=0)
        shutil.rmtree(self.shm_root, ignore_errors=True)

    # -- shared state -----------------------------------------------------------------------------
    def vllm_interpreter(self) -> Path:
        """The Python that runs vLLM containers; a ValueError (the pod's waiting message) says how to get one."""
        if self.vllm_python is not None:
            if not self.vllm_python.is_file():
                raise ValueError(f"the vLLM interpreter {self.vllm_python} does not exist (--vllm-python)")
            return self.vllm_python
        from daybreak.devenv import vllmenv  # only pods that run vLLM need it

        found = vllmenv.find()
        if found is None:
            raise ValueError("this pod runs vLLM but no vLLM environment is installed: run `make vllm-env`, or "
                             "start the cluster with `daybreak dev up --vllm-python PATH`")
        return found

    def register_process(self, proc: subprocess.Popen[bytes]) -> None:
        with self._lock:
            self._processes.add(proc)

    def unregister_process(self, proc: subprocess.Popen[bytes]) -> None:
        with self._lock:
            self._processes.discard(proc)

    def pids(self) -> list[int]:
        with self._lock:
            return [p.pid for p in self._processes if p.poll() is None]

    def node_shm_dir(self, node: str) -> Path:
        path = self.shm_root / node
        path.mkdir(parents=True, exist_ok=True)
        return path

    def allocate_ip(self, uid: str, *, previous: str = "") -> str:
        """A loopback address of its own for the pod ``uid`` (kept until the pod is gone): 127.X.1.1 and up.

        ``previous`` is the address the pod's status already holds (a cluster restarted with ``dev down``
        and ``dev up``, whose pods this kubelet starts again): it is kept when it is still this cluster's
        and free, so the pod's address, its EndpointSlice entries and whatever dialled it stay valid.
        """
        network = self.slot.network
        first, count = 256, network.num_addresses - 256  # 127.X.0.0/24 is the nodes'
        with self._lock:
            if uid in self._ips:
                return self._ips[uid]
            used = set(self._ips.values())
            if previous and self._reusable(previous, used):
                self._ips[uid] = previous
                return previous
            for _ in range(count):
                candidate = str(network.network_address + first + self._next_ip)
                self._next_ip = (self._next_ip + 1) % count
                if candidate not in used and not candidate.endswith((".0", ".255")):
                    self._ips[uid] = candidate
                    return candidate
        raise ValueError(f"no free pod address left in {network}")

    def _reusable(self, address: str, used: set[str]) -> bool:
        """``address`` is a pod address of this cluster's slot that no other pod holds."""
        try:
            ip = ipaddress.IPv4Address(address)
        except ValueError:
            return False
        network = self.slot.network
        return (ip in network and int(ip) - int(network.network_address) >= 256 and address not in used
                and not address.endswith((".0", ".255")))

    def node_ip(self, api: httpx.Client, node: str) -> str:
        """The node's loopback InternalIP (127.0.1.N); a node made without one gets one of its own here."""
        with self._lock:
            if self._nodes.get(node):
                return self._nodes[node]
        obj = _check(api.get(f"/api/v1/nodes/{node}"), f"node {node}")
        address = next((a["address"] for a in (obj.get("status") or {}).get("addresses") or []
                        if a.get("type") == "InternalIP"), "")
        with self._lock:
            if not address.startswith(self.slot.node_prefix):
                # Not made by LocalCluster.create_fake_nodes: the kubelet's own address, not published.
                address = self.slot.node_address(self._extra_node_index)
                self._extra_node_index += 1
            self._nodes[node] = address
        return address

    def forget(self, worker: PodWorker) -> None:
        with self._lock:
            if self.workers.get(worker.uid) is worker:
                del self.workers[worker.uid]
            self._ips.pop(worker.uid, None)
            self._done.add(worker.uid)
        self.endpoints_changed(worker.namespace)

    def endpoints_changed(self, namespace: str) -> None:
        with self._lock:
            self._dirty.add(namespace)
        self._dirty_event.set()

    # -- the pod watch --------------------------------------------------------------------------------
    def _is_fake_node(self, api: httpx.Client, node: str) -> bool:
        resp = api.get(f"/api/v1/nodes/{node}")
        if resp.status_code != 200:
            return False
        annotations = (resp.json().get("metadata") or {}).get("annotations") or {}
        return annotations.get(self.fake_node_annotation) == "fake"

    def _handle(self, api: httpx.Client, kind: str, pod: dict[str, Any]) -> None:
        meta = pod.get("metadata") or {}
        uid = str(meta.get("uid") or "")
        with self._lock:
            worker = self.workers.get(uid)
            if worker is None and uid in self._done:
                if kind == "DELETED":
                    self._done.discard(uid)
                return
        if kind == "DELETED":
            if worker is not None:
                worker.update(pod)
                worker.gone.set()
            return
        if worker is not None:
            worker.update(pod)
            return
        node = (pod.get("spec") or {}).get("nodeName")
        if not node or not is_process_pod(pod) or self._stop.is_set():
            return
        phase = (pod.get("status") or {}).get("phase")
        if phase in ("Succeeded", "Failed"):
            return  # finished before we (re)started: nothing to run
        if not self._is_fake_node(api, str(node)):
            return
        previous = str((pod.get("status") or {}).get("podIP") or "")
        if previous and not pod["spec"].get("hostNetwork"):
            # A pod this kubelet (or the one before a restart) ran: claim its address now, while the relist
            # goes through the existing pods, so no pod created after it is handed that address first.
            with contextlib.suppress(ValueError):  # none left: the worker's _prepare reports it
                self.allocate_ip(uid, previous=previous)
        worker = PodWorker(self, pod)
        with self._lock:
            self.workers[uid] = worker
        worker.start()

    def _watch_pods(self) -> None:
        api = self.api_factory()
        backoff = 0.5
        try:
            while not self._stop.is_set():
                try:
                    version = self._relist(api)
                    self._watch(api, version)
                    backoff = 0.5
                except (httpx.HTTPError, ApiError, ValueError) as exc:
                    if self._stop.is_set():
                        break
                    log.warning("event=pod_watch_failed error=%r retry_in=%.1fs", exc, backoff)
                    self._stop.wait(backoff)
                    backoff = min(backoff * 2, 5.0)
        finally:
            api.close()

    def _relist(self, api: httpx.Client) -> str:
        body = _check(api.get("/api/v1/pods", params={"fieldSelector": "spec.nodeName!="}), "list pods")
        seen = set()
        for pod in body.get("items") or []:
            seen.add(pod["metadata"]["uid"])
            self._handle(api, "ADDED", pod)
        with self._lock:
            vanished = [w for uid, w in self.workers.items() if uid not in seen]
        for w in vanished:  # deleted while the watch was down
            w.gone.set()
        return str((body.get("metadata") or {}).get("resourceVersion") or "")

    def _watch(self, api: httpx.Client, version: str) -> None:
        params = {"watch": "true", "fieldSelector": "spec.nodeName!=", "resourceVersion": version,
                  "allowWatchBookmarks": "true", "timeoutSeconds": "60"}
        with api.stream("GET", "/api/v1/pods", params=params, timeout=httpx.Timeout(30.0, read=90.0)) as resp:
            if resp.status_code != 200:
                raise ApiError(f"watch pods: {resp.status_code}")
            for line in resp.iter_lines():
                if self._stop.is_set():
                    return
                if not line.strip():
                    continue
                event = json.loads(line)
                kind, obj = event.get("type"), event.get("object") or {}
                if kind == "ERROR":
                    return  # 410 Gone and friends: relist
                if kind == "BOOKMARK":
                    continue
                self._handle(api, str(kind), obj)

    # -- EndpointSlices -------------------------------------------------------------------------------
    def _mirror_endpoints(self) -> None:
        api = self.api_factory()
        last_full = 0.0
        try:
            while not self._stop.is_set():
                self._dirty_event.wait(1.0)
                self._dirty_event.clear()
                with self._lock:
                    namespaces = set(self._dirty) | {w.namespace for w in self.workers.values()}
                    self._dirty.clear()
                if time.monotonic() - last_full > 5.0:
                    last_full = time.monotonic()  # new Services show up within 5 s
                elif not namespaces:
                    continue
                for ns in sorted(namespaces):
                    if self._stop.is_set():
                        break
                    try:
                        self._mirror_namespace(api, ns)
                    except (httpx.HTTPError, ApiError, ValueError, KeyError) as exc:
                        log.warning("event=endpointslice_mirror_failed namespace=%s error=%r (retried)", ns, exc)
                        self.endpoints_changed(ns)
                        self._stop.wait(0.5)
        finally:
            api.close()

    def _mirror_namespace(self, api: httpx.Client, namespace: str) -> None:
        with self._lock:
            pods = [w for w in self.workers.values() if w.namespace == namespace and w.pod_ip]
        services = _check(api.get(f"/api/v1/namespaces/{namespace}/services"), "list services").get("items") or []
        existing = _check(api.get(f"/apis/discovery.k8s.io/v1/namespaces/{namespace}/endpointslices",
                                  params={"labelSelector": f"endpointslice.kubernetes.io/managed-by={MANAGER}"}),
                          "list endpointslices").get("items") or []
        wanted: dict[str, dict[str, Any]] = {}
        for svc in services:
            slice_ = desired_slice(svc, [(w.current(), w) for w in pods])
            if slice_ is not None:
                wanted[slice_["metadata"]["name"]] = slice_
        for name, body in wanted.items():
            resp = api.patch(f"/apis/discovery.k8s.io/v1/namespaces/{namespace}/endpointslices/{name}",
                             params={"fieldManager": MANAGER, "force": "true"}, content=json.dumps(body),
                             headers={"Content-Type": "application/apply-patch+yaml"})
            _check(resp, f"apply EndpointSlice {namespace}/{name}")
        for obj in existing:
            name = obj["metadata"]["name"]
            if name not in wanted:
                api.delete(f"/apis/discovery.k8s.io/v1/namespaces/{namespace}/endpointslices/{name}")


def _selects(selector: dict[str, str], pod: dict[str, Any]) -> bool:
    labels = (pod.get("metadata") or {}).get("labels") or {}
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def slice_name(service: str) -> str:
    name = f"{service}-{SLICE_SUFFIX}"
    if len(name) <= 63:
        return name
    digest = hashlib.sha256(service.encode()).hexdigest()[:8]
    return f"{service[: 63 - len(SLICE_SUFFIX) - 10]}-{digest}-{SLICE_SUFFIX}"


def desired_slice(service: dict[str, Any], pods: list[tuple[dict[str, Any], Any]]) -> dict[str, Any] | None:
    """The FQDN EndpointSlice mirroring ``service``'s process pods, or None when it selects none of them.

    ``pods`` are ``(pod object, worker)`` with ``worker.pod_ip``, ``worker.node`` and ``worker.status(pod)``.
    """
    spec = service.get("spec") or {}
    selector = spec.get("selector") or {}
    meta = service["metadata"]
    matched = [(p, w) for p, w in pods if _selects(selector, p)]
    if not matched or spec.get("type") == "ExternalName":
        return None
    publish_not_ready = bool(spec.get("publishNotReadyAddresses"))
    first = matched[0][0]
    ports = []
    for sp in spec.get("ports") or []:
        target = sp.get("targetPort", sp.get("port"))
        port = None
        for c in (first.get("spec") or {}).get("containers") or []:
            with contextlib.suppress(ValueError):
                port = resolve_port(target, c)
                break
        entry: dict[str, Any] = {"port": int(port if port is not None else sp.get("port")),
                                 "protocol": sp.get("protocol") or "TCP"}
        if sp.get("name"):
            entry["name"] = sp["name"]
        ports.append(entry)
    endpoints = []
    for pod, worker in sorted(matched, key=lambda pw: pw[1].pod_ip):
        status = worker.last_status or {}
        ready_cond: dict[str, Any] = next((c for c in status.get("conditions") or [] if c["type"] == "Ready"), {})
        terminating = bool((pod.get("metadata") or {}).get("deletionTimestamp")) or worker.terminating
        ready = ready_cond.get("status") == "True" and not terminating
        endpoints.append({
            "addresses": [worker.pod_ip],
            "conditions": {"ready": ready or (publish_not_ready and not terminating), "serving": ready,
                           "terminating": terminating},
            "nodeName": worker.node,
            "targetRef": {"kind": "Pod", "namespace": meta["namespace"], "name": pod["metadata"]["name"],
                          "uid": pod["metadata"]["uid"]},
        })
    return {
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {"name": slice_name(meta["name"]), "namespace": meta["namespace"],
                     "labels": {"kubernetes.io/service-name": meta["name"],
                                "endpointslice.kubernetes.io/managed-by": MANAGER},
                     "ownerReferences": [{"apiVersion": "v1", "kind": "Service", "name": meta["name"],
                                          "uid": meta["uid"], "controller": True, "blockOwnerDeletion": True}]},
        # Loopback addresses are refused in IPv4 slices; FQDN slices carry them (a dotted quad is a valid name).
        "addressType": "FQDN",
        "endpoints": endpoints,
        "ports": ports,
    }


def kill_leftovers(directory: Path) -> list[int]:
    """SIGKILL the process groups of pods a dead supervisor left running, and drop the nodes' shared memory.

    Only pids recorded by this cluster's kubelet whose command line is still one it starts are touched.
    """
    killed = []
    for pid_file in sorted((directory / "pods").glob("*/*.pid")):
        with contextlib.suppress(ValueError, OSError):
            pid = int(pid_file.read_text().strip())
            argv = [a.decode(errors="replace") for a in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")]
            # The venv's script runs as `python .../daybreak ...`: the name is argv[0] or argv[1]; vLLM as
            # `python -m vllm...`.
            if any(Path(a).name == DAYBREAK_COMMAND for a in argv[:2]) or VLLM.matches(argv):
                os.killpg(pid, signal.SIGKILL)
                killed.append(pid)
        pid_file.unlink(missing_ok=True)
    shutil.rmtree(shm_root(directory), ignore_errors=True)
    return killed


def iter_logs(directory: Path, *, namespace: str, pod: str) -> Iterator[Path]:
    """The log files of ``pod`` (one per container) under a cluster directory."""
    pod_dir = directory / "pods" / pod_dir_name(namespace, pod)
    yield from sorted(pod_dir.glob("*.log"))
