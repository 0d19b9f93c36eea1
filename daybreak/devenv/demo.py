"""``make demo``: the main job on the embedded local cluster, step by step.

Starts a local cluster with fake Sunrise nodes, then walks through what a
platform engineer does. Holds the cluster until Ctrl-C when run from a
terminal (``DEMO_HOLD=0`` to exit straight away); always tears it down.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from daybreak.devenv import tools
from daybreak.devenv.cluster import ClusterSpec, LocalCluster

ROOT = Path(__file__).resolve().parent.parent.parent


def step(title: str) -> None:
    print(f"\n=== {title}", flush=True)


def kubectl(cluster: LocalCluster, *args: str) -> str:
    out = subprocess.run([str(tools.find("kubectl")), f"--kubeconfig={cluster.kubeconfig}", *args],
                         capture_output=True, text=True, check=False)
    text = (out.stdout + out.stderr).rstrip()
    print(f"$ kubectl {' '.join(args)}\n{text}", flush=True)
    if out.returncode != 0:
        raise SystemExit(f"demo step failed: kubectl {' '.join(args)}")
    return text


def main() -> int:
    directory = ROOT / ".daybreak" / "demo-cluster"
    step("starting a local control plane with 2 fake nodes of 8 Sunrise devices each")
    cluster = LocalCluster(directory, ClusterSpec(nodes=2, devices_per_node=8), progress=lambda m: print(m, flush=True))
    started = time.monotonic()
    with cluster:
        print(f"cluster ready in {time.monotonic() - started:.1f}s; KUBECONFIG={cluster.kubeconfig}")
        step("the fake accelerator nodes")
        kubectl(cluster, "get", "nodes", "-L", "daybreak.dev/accelerator,daybreak.dev/accelerator-count")
        operators = operator_demo(cluster, directory)
        hold = os.environ.get("DEMO_HOLD", "1" if sys.stdin.isatty() else "0") != "0"
        if hold:
            print(f"\nThe cluster stays up: export KUBECONFIG={cluster.kubeconfig}\nPress Ctrl-C to tear it down.")
            try:
                while True:
                    time.sleep(3600)
            except KeyboardInterrupt:
                print()
        step("tearing down")
        for op in operators:
            op.stop()
    print("done")
    return 0


def operator_demo(cluster: LocalCluster, directory: Path) -> list[Any]:
    """CRDs, the operator as two replicas under leader election, the examples, and what they became."""
    from daybreak.operator.process import OperatorProcess

    step("installing the CRDs and the agents' node ClusterRole + admission policy (from the Helm chart)")
    kubectl(cluster, "apply", "-f", str(ROOT / "crds"))
    rbac = subprocess.run([str(tools.find("helm")), "template", "daybreak", str(ROOT / "charts" / "daybreak"),
                           "--kube-version", "1.37.2", "--show-only", "templates/agent-rbac.yaml"],
                          capture_output=True, text=True, check=True).stdout
    subprocess.run([str(tools.find("kubectl")), f"--kubeconfig={cluster.kubeconfig}", "apply", "-f", "-"],
                   input=rbac, text=True, check=True)

    step("starting the operator: two replicas, one leads through a Lease (logs in .daybreak/)")
    operators = [OperatorProcess(kubeconfig=cluster.kubeconfig, log_path=directory / f"operator-{x}.log",
                                 identity=f"operator-{x}", lease_namespace="default", resync_seconds=10.0).start()
                 for x in ("a", "b")]
    _until("a leader", lambda: "operator-" in kubectl_quiet(cluster, "get", "lease", "daybreak-operator",
                                                             "-o", "jsonpath={.spec.holderIdentity}"))
    kubectl(cluster, "get", "lease", "daybreak-operator", "-o",
            "custom-columns=LEASE:.metadata.name,HOLDER:.spec.holderIdentity")

    step("kubectl apply -f examples/")
    kubectl(cluster, "apply", "-f", str(ROOT / "examples"))
    _until("sim-llama Ready", lambda: kubectl_quiet(
        cluster, "get", "pdd", "sim-llama", "-o", "jsonpath={.status.conditions[?(@.type=='Ready')].status}") == "True",
        timeout=180)

    step("the pools and deployments")
    kubectl(cluster, "get", "kvp,pdd", "-o", "wide")
    step("their pods (kwok plays the kubelets)")
    kubectl(cluster, "get", "pods", "-o", "wide")
    step("status of sim-llama")
    kubectl(cluster, "get", "pdd", "sim-llama", "-o",
            "jsonpath={range .status.conditions[*]}{.type}={.status} {.reason}: {.message}{'\\n'}{end}"
            "kvNamespace={.status.kvNamespace} revision={.status.revision}{'\\n'}")
    step("status of kv-production (its nodeSelector wants daybreak.dev/rdma=true, which no fake node has)")
    kubectl(cluster, "get", "kvp", "kv-production", "-o",
            "jsonpath={range .status.conditions[*]}{.type}={.status} {.reason}: {.message}{'\\n'}{end}")
    step("what the operator said")
    kubectl(cluster, "get", "events", "--field-selector", "source=daybreak-operator",
            "--sort-by=.lastTimestamp")
    return operators


def kubectl_quiet(cluster: LocalCluster, *args: str) -> str:
    out = subprocess.run([str(tools.find("kubectl")), f"--kubeconfig={cluster.kubeconfig}", *args],
                         capture_output=True, text=True, check=False)
    return out.stdout.strip()


def _until(what: str, probe: Any, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not probe():
        if time.monotonic() > deadline:
            raise SystemExit(f"demo step failed: no {what} after {timeout:.0f}s")
        time.sleep(0.5)


if __name__ == "__main__":
    sys.exit(main())
