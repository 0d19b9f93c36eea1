"""The demo's cluster steps: helm install, the example objects, waiting for them, killing an agent.

Each step prints what it runs (the ``kubectl`` / ``helm`` line a user would
type) and fails with a message naming the step and the log to read.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from daybreak.api import labels as vocab
from daybreak.devenv import tools
from daybreak.devenv.cluster import LocalCluster
from daybreak.errors import DaybreakError

log = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parents[3]
CHART = ROOT / "charts" / "daybreak"
MANIFEST = ROOT / "examples" / "demo.yaml"
RELEASE = "daybreak"
RELEASE_NS = "daybreak-system"
NS = "demo"
DEPLOYMENT = "demo"


class DemoError(DaybreakError, RuntimeError):
    """A demo step failed; the message says which and where to look."""


def step(title: str) -> None:
    print(f"\n=== {title}", flush=True)


def run_tool(cluster: LocalCluster, tool: str, *args: str, show: bool = True, stdin: str | None = None,
             timeout: float = 240) -> str:
    """Run kubectl or helm against ``cluster``; prints the command and its output when ``show``."""
    flag = f"--kubeconfig={cluster.kubeconfig}"
    out = subprocess.run([str(tools.find(tool)), flag, *args], capture_output=True, text=True, input=stdin,
                         timeout=timeout, check=False)
    text = (out.stdout + out.stderr).rstrip()
    if show:
        print(f"$ {tool} {' '.join(args)}\n{text}", flush=True)
    if out.returncode != 0:
        raise DemoError(f"demo step failed: {tool} {' '.join(args)}\n{text}")
    return out.stdout.strip()


def kubectl(cluster: LocalCluster, *args: str, show: bool = True) -> str:
    return run_tool(cluster, "kubectl", *args, show=show)


def until(what: str, probe: Callable[[], Any], *, timeout: float = 120.0, hint: str = "") -> Any:
    deadline = time.monotonic() + timeout
    while True:
        try:
            value = probe()
        except (subprocess.SubprocessError, DemoError, KeyError, ValueError):
            value = None
        if value:
            return value
        if time.monotonic() > deadline:
            raise DemoError(f"demo step failed: no {what} after {timeout:.0f}s. {hint}")
        time.sleep(0.5)


def install_chart(cluster: LocalCluster) -> None:
    """The chart as a platform engineer installs it: CRDs, RBAC, policies, two operator replicas."""
    step("helm install: CRDs, the operator (2 replicas under leader election), RBAC, admission policies")
    args = ["install", RELEASE, str(CHART), "--namespace", RELEASE_NS, "--create-namespace",
            "--set", "operator.replicas=2", "--set", "operator.resyncSeconds=10", "--wait", "--timeout", "240s"]
    out = run_tool(cluster, "helm", *args, show=False)
    # The release lines; the chart's NOTES (next steps for a real cluster) are `helm get notes daybreak`.
    print(f"$ helm {' '.join(args)}\n{out.split('NOTES:')[0].rstrip()}", flush=True)
    holder = until("operator leader", lambda: kubectl(
        cluster, "-n", RELEASE_NS, "get", "lease", "daybreak-operator", "-o", "jsonpath={.spec.holderIdentity}",
        show=False), timeout=60, hint=f"see `daybreak dev logs` of the operator pods in {RELEASE_NS}")
    kubectl(cluster, "-n", RELEASE_NS, "get", "pods", "-o", "wide")
    print(f"leader: {holder} (the other replica stands by)", flush=True)


def apply_examples(cluster: LocalCluster) -> str:
    """The demo pool and PDDeployment; returns the router's base URL once every role serves."""
    step(f"kubectl apply -n {NS} -f examples/demo.yaml (a KVPool and a sim PDDeployment, autoscaling on)")
    kubectl(cluster, "create", "namespace", NS)
    kubectl(cluster, "apply", "-n", NS, "-f", str(MANIFEST))

    def ready(role: str) -> bool:
        n = kubectl(cluster, "-n", NS, "get", "deployment", f"{DEPLOYMENT}-{role}", "-o",
                    "jsonpath={.status.readyReplicas}", show=False)
        return bool(n) and int(n) >= 1

    until("ready engines and router", lambda: all(ready(r) for r in ("prefill", "decode", "router")),
          timeout=240, hint=f"kubectl -n {NS} get pods; daybreak dev logs POD")
    kubectl(cluster, "get", "kvp,pdd", "-n", NS, "-o", "wide")
    kubectl(cluster, "get", "pods", "-n", NS, "-o", "wide")
    ip = kubectl(cluster, "-n", NS, "get", "pod", "-l", f"{vocab.DEPLOYMENT}={DEPLOYMENT},{vocab.ROLE}=router",
                 "--field-selector=status.phase=Running", "-o", "jsonpath={.items[0].status.podIP}", show=False)
    if not ip:
        raise DemoError("demo step failed: the router pod has no IP; kubectl -n demo get pods -o wide")
    return f"http://{ip}:8000"


def kill_agent(cluster: LocalCluster) -> str:
    """SIGKILL one agent pod's process (no hand-off); the process kubelet restarts it. Returns the pod name."""
    pods = kubectl(cluster, "-n", NS, "get", "pods", "-l", f"{vocab.NAME}=daybreak-agent", "-o",
                   "jsonpath={.items[*].metadata.name}", show=False).split()
    if not pods or cluster.kubelet is None:
        raise DemoError("demo step failed: no agent pod to kill; kubectl -n demo get pods")
    name = sorted(pods)[0]
    for worker in list(cluster.kubelet.workers.values()):
        if worker.namespace == NS and worker.pod_name == name:
            for c in worker.containers:
                if c.process is not None and c.process.poll() is None:
                    os.kill(c.process.pid, signal.SIGKILL)
                    return name
    raise DemoError(f"demo step failed: agent pod {name} has no running process")


def restarts(cluster: LocalCluster, pod: str) -> int:
    out = kubectl(cluster, "-n", NS, "get", "pod", pod, "-o", "jsonpath={.status.containerStatuses[0].restartCount}",
                  show=False)
    return int(out or 0)
