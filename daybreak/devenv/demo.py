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
        hold = os.environ.get("DEMO_HOLD", "1" if sys.stdin.isatty() else "0") != "0"
        if hold:
            print(f"\nThe cluster stays up: export KUBECONFIG={cluster.kubeconfig}\nPress Ctrl-C to tear it down.")
            try:
                while True:
                    time.sleep(3600)
            except KeyboardInterrupt:
                print()
        step("tearing down")
    print("done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
