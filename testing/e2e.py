"""The shared part of the end-to-end tests on the local cluster: setup, teardown, waiting, a Service stand-in.

Every e2e test file needs the same steps around its scenario: the CRDs and the chart's agent RBAC
applied, a namespace of its own, an admin API client, and at the end the namespace deleted with its
pods really gone (an agent's ``KVNode`` is per node, not per pool: one left behind would be summed into
the next test's pool). ``E2ENamespace`` does those steps once; ``wait_for`` is the one polling loop
with a failure message that names what it waited for.

``ServiceProxy`` stands in for kube-proxy, which the local cluster does not run: a loopback listener
that sends each new connection to a ready endpoint of a Service's EndpointSlices, as a ClusterIP does
in a cluster, so a test can talk to "the router Service" through a rolling upgrade of the router.
"""

from __future__ import annotations

import json
import logging
import os
import random
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import httpx

from daybreak.api import labels as vocab
from daybreak.devenv import tools
from daybreak.devenv.cluster import LocalCluster
from daybreak.errors import DaybreakError

log = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parents[1]  # the source tree (the package is installed editable)
CHART = ROOT / "charts" / "daybreak"
CRDS = ROOT / "crds"
T = TypeVar("T")
# The API errors a probe may hit while things start or roll (a 404 of a child not created yet, a pod
# without an IP yet): remembered for the failure message and retried.
PROBE_ERRORS: tuple[type[BaseException], ...] = (httpx.HTTPError, KeyError, IndexError, TypeError, ValueError)


class WaitTimeout(DaybreakError, AssertionError):
    """A condition an e2e test waited for did not come true in time (an AssertionError: a test failure)."""


def wait_for(what: str, probe: Callable[[], T | None], *, timeout: float = 120.0, interval: float = 0.3,
             diagnose: Callable[[], str] | None = None) -> T:
    """Poll ``probe`` until it returns something truthy and return that; raise WaitTimeout naming ``what``.

    A probe that raises one of PROBE_ERRORS is retried (an exception object is truthy, so it is never
    taken as the answer); ``diagnose`` adds logs to the failure message.
    """
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = probe()
            if last:
                return last
        except PROBE_ERRORS as exc:
            last = exc
        time.sleep(interval)
    raise WaitTimeout(f"timed out after {timeout:.0f} s waiting for {what}; last={last!r}\n"
                      f"{diagnose() if diagnose else ''}")


def agent_rbac() -> str:
    """The chart's agent RBAC (the ClusterRole and the shared ClusterRoleBinding the operator edits), rendered."""
    return subprocess.run([str(tools.find("helm")), "template", "t", str(CHART), "--kube-version", "1.37.2",
                           "--show-only", "templates/agent-rbac.yaml"],
                          capture_output=True, text=True, check=True, timeout=60).stdout


def is_ready(pod: dict[str, Any]) -> bool:
    """A pod that is not terminating and whose Ready condition is True."""
    return not pod["metadata"].get("deletionTimestamp") and any(
        c.get("type") == "Ready" and c.get("status") == "True" for c in (pod.get("status") or {}).get("conditions") or [])


@dataclass
class E2ENamespace:
    """One e2e test file's namespace on the shared local cluster; ``open()`` it, ``close()`` it."""

    cluster: LocalCluster
    namespace: str
    rbac: str = ""
    api: httpx.Client | None = None

    def open(self) -> E2ENamespace:
        """Apply the CRDs and the agent RBAC, create the namespace, open an admin API client."""
        self.cluster.kubectl("apply", "-f", str(CRDS))
        self.rbac = agent_rbac()
        self.cluster.kubectl("apply", "-f", "-", stdin=self.rbac)
        self.cluster.kubectl("create", "namespace", self.namespace)
        self.api = self.cluster.api()
        return self

    @property
    def client(self) -> httpx.Client:
        if self.api is None:
            raise DaybreakError("E2ENamespace.open() first")
        return self.api

    def get(self, path: str) -> dict[str, Any] | None:
        """GET an API path; None on 404."""
        resp = self.client.get(path)
        if resp.status_code == 404:
            return None
        resp.raise_for_status()
        return dict(resp.json())

    def pods(self, selector: str = "") -> list[dict[str, Any]]:
        body = self.get(f"/api/v1/namespaces/{self.namespace}/pods" + (f"?labelSelector={selector}" if selector
                                                                        else "")) or {}
        return list(body.get("items") or [])

    def ready_pods(self, selector: str = "") -> list[dict[str, Any]]:
        return [p for p in self.pods(selector) if is_ready(p)]

    def events(self, name: str) -> list[dict[str, Any]]:
        body = self.get(f"/api/v1/namespaces/{self.namespace}/events?fieldSelector=involvedObject.name={name}") or {}
        return list(body.get("items") or [])

    def apply(self, *manifests: dict[str, Any]) -> None:
        self.cluster.kubectl("apply", "-n", self.namespace, "-f", "-",
                             stdin="\n---\n".join(json.dumps(m) for m in manifests))

    def pod_logs(self, prefix: str = "", *, tail: int = 1500) -> str:
        """The tails of the process kubelet's container logs of this namespace's pods (names starting ``prefix``)."""
        lines = []
        for path in sorted((self.cluster.directory / "pods").glob(f"{self.namespace}_{prefix}*/*.log")):
            lines.append(f"--- {path.parent.name}/{path.name} ---\n{path.read_text(errors='replace')[-tail:]}")
        return "\n".join(lines)

    def close(self, *, nodes: Sequence[str] = ("daybreak-node-0", "daybreak-node-1"),
              wait_seconds: float = 120.0) -> None:
        """Delete the namespace, wait (bounded) until its pods are gone, then delete the ``KVNode``s of
        ``nodes`` (the agents publish them) and the agent RBAC."""
        self.cluster.kubectl("delete", "namespace", self.namespace, "--wait=false", check=False)
        if self.api is not None:
            deadline = time.monotonic() + wait_seconds
            while time.monotonic() < deadline:
                try:
                    if not self.pods():
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.5)
            for node in nodes:
                try:
                    self.api.delete(f"/apis/{vocab.API_VERSION}/{vocab.KVNODE_PLURAL}/{node}")
                except httpx.HTTPError as exc:
                    log.warning("event=kvnode_delete_failed node=%s error=%s", node, exc)
        if self.rbac:
            self.cluster.kubectl("delete", "-f", "-", "--wait=false", "--ignore-not-found", stdin=self.rbac,
                                 check=False)
        if self.api is not None:
            self.api.close()
            self.api = None


def daybreak_command() -> str:
    """The venv's ``daybreak`` script (the one next to the running interpreter)."""
    return str(Path(sys.executable).with_name("daybreak"))


def child_env() -> dict[str, str]:
    """The environment for a ``daybreak`` child process: the source tree's modules, not the cwd's."""
    return {**os.environ, "PYTHONSAFEPATH": "1"}


def run_load(url: str, out: Path, args: Sequence[str], *, timeout: float, check: bool = True) -> dict[str, Any]:
    """``daybreak load --url URL --json OUT ARGS``; returns its summary (raises on a failed run when ``check``)."""
    proc = subprocess.run([daybreak_command(), "load", "--url", url, "--quiet", "--json", str(out), *args],
                          capture_output=True, text=True, timeout=timeout, env=child_env())
    if check and proc.returncode != 0:
        raise DaybreakError(f"daybreak load failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return dict(json.loads(out.read_text()))


@dataclass
class ServiceProxy:
    """A loopback stand-in for a Service's virtual IP: each new connection goes to one ready endpoint.

    Like kube-proxy, it follows the Service's EndpointSlices (re-read every ``refresh_seconds``; an
    endpoint counts only while its ``ready`` condition is true, so a terminating pod gets no new
    connections) and never moves a connection once made. ``url`` is what a client dials.
    """

    api: httpx.Client
    namespace: str
    service: str
    port_name: str = "http"
    refresh_seconds: float = 0.5
    connections: dict[str, int] = field(default_factory=dict)  # backend -> connections sent there
    _endpoints: list[str] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _listener: socket.socket | None = None
    _threads: list[threading.Thread] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def start(self) -> ServiceProxy:
        self._refresh()
        listener = socket.create_server(("127.0.0.1", 0))
        listener.settimeout(0.2)
        self._listener = listener
        for target in (self._follow, self._accept):
            t = threading.Thread(target=target, daemon=True, name=f"svc-proxy-{self.service}")
            t.start()
            self._threads.append(t)
        return self

    @property
    def url(self) -> str:
        if self._listener is None:
            raise DaybreakError("ServiceProxy.start() first")
        return f"http://127.0.0.1:{self._listener.getsockname()[1]}"

    def endpoints(self) -> list[str]:
        with self._lock:
            return list(self._endpoints)

    def _refresh(self) -> None:
        resp = self.api.get(f"/apis/discovery.k8s.io/v1/namespaces/{self.namespace}/endpointslices",
                            params={"labelSelector": f"kubernetes.io/service-name={self.service}"})
        resp.raise_for_status()
        found = []
        for eps in resp.json().get("items") or []:
            ports = [p.get("port") for p in eps.get("ports") or [] if p.get("name") == self.port_name]
            for ep in eps.get("endpoints") or []:
                if (ep.get("conditions") or {}).get("ready") and ports:
                    found += [f"{address}:{ports[0]}" for address in ep.get("addresses") or []]
        with self._lock:
            self._endpoints = sorted(found)

    def _follow(self) -> None:
        while not self._stop.wait(self.refresh_seconds):
            try:
                self._refresh()
            except httpx.HTTPError as exc:  # keep the last list, as kube-proxy does while the API is away
                log.warning("event=endpoints_refresh_failed service=%s error=%s", self.service, exc)

    def _accept(self) -> None:
        assert self._listener is not None
        while not self._stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            threading.Thread(target=self._connect, args=(conn,), daemon=True).start()

    def _connect(self, conn: socket.socket) -> None:
        conn.settimeout(None)
        backends = self.endpoints()
        if not backends:  # no ready endpoint: a ClusterIP rejects the connection
            conn.close()
            return
        backend = random.choice(backends)
        host, _, port = backend.rpartition(":")
        try:
            upstream = socket.create_connection((host, int(port)), timeout=5.0)
        except OSError:
            conn.close()
            return
        upstream.settimeout(None)
        with self._lock:
            self.connections[backend] = self.connections.get(backend, 0) + 1
        back = threading.Thread(target=_pipe, args=(upstream, conn), daemon=True)
        back.start()
        _pipe(conn, upstream)
        back.join(timeout=120)
        conn.close()
        upstream.close()

    def stop(self) -> None:
        self._stop.set()
        if self._listener is not None:
            self._listener.close()
        for t in self._threads:
            t.join(timeout=5)


def _pipe(src: socket.socket, dst: socket.socket) -> None:
    """Copy ``src`` to ``dst`` until EOF, then pass the half-close on (so HTTP keep-alive behaves as direct)."""
    try:
        while chunk := src.recv(65536):
            dst.sendall(chunk)
    except OSError:
        pass
    finally:
        try:
            dst.shutdown(socket.SHUT_WR)
        except OSError:
            pass
