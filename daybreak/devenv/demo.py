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
        store_demo(directory)
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
    step("their pods: agents, engines and the router run as local processes on their own loopback addresses "
         "(the process kubelet; `daybreak dev logs POD` shows a log)")
    kubectl(cluster, "get", "pods", "-o", "wide")
    serving_demo(cluster)
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


def serving_demo(cluster: LocalCluster) -> None:
    """One streamed completion from the router's pod address: prefill writes KV to the pool, decode reads it."""
    import json

    import httpx

    router = kubectl_quiet(cluster, "get", "pod", "-l", "daybreak.dev/deployment=sim-llama,daybreak.dev/role=router",
                           "-o", "jsonpath={.items[0].status.podIP}")
    step(f"curl -N http://{router}:8000/v1/completions (streamed, through prefill and decode)")
    body = {"prompt": "Daybreak pools the KV cache of every prefill for every decode. " * 4, "max_tokens": 12,
            "stream": True, "stream_options": {"include_usage": True}}
    text, usage = [], None
    with httpx.stream("POST", f"http://{router}:8000/v1/completions", json=body, timeout=60) as resp:
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line.removeprefix("data: "))
            text += [c.get("text") or "" for c in chunk.get("choices") or []]
            usage = chunk.get("usage") or usage
    print(f"tokens: {''.join(text)!r}\nusage: {json.dumps(usage)}", flush=True)


def store_demo(directory: Path) -> None:
    """The data plane on this machine: two store agents, KV blocks in, an agent killed, blocks still there."""
    import hashlib
    import uuid

    from daybreak.agent.store.local import LocalAgent, cleanup_pool, free_port
    from daybreak.client import KVPoolClient

    step("the KV pool's data plane: two standalone agents on loopback, 2 replicas (the DaemonSet's job in a cluster)")
    pool = f"demo-{uuid.uuid4().hex[:6]}"
    token = directory / "store-token"
    a, b = (f"127.0.0.1:{free_port()}" for _ in range(2))
    agents = [LocalAgent(address=a, token_file=token, pool=pool, dram="512Mi", peers=[b], replicas=2,
                         log_path=directory / "agent-a.log").start()]
    agents.append(LocalAgent(address=b, token_file=token, pool=pool, dram="512Mi", peers=[a], replicas=2,
                             log_path=directory / "agent-b.log").start())
    try:
        blocks = [os.urandom(1 << 20) for _ in range(128)]
        keys = [f"prefix-{i:04d}" for i in range(len(blocks))]
        client = KVPoolClient([a], token=token.read_text().strip(), namespace="kv1-demo")
        t = time.monotonic()
        copies = client.batch_put(keys, blocks)
        put_s = time.monotonic() - t
        print(f"put {len(blocks)} x 1 MiB in {put_s * 1000:.0f} ms ({len(blocks) / 1024 / put_s:.2f} GiB/s), "
              f"copies per key: {min(copies)}..{max(copies)}")
        agents[0].kill()
        print(f"killed agent {a} (SIGKILL: no hand-off)")
        reader = KVPoolClient([b], token=token.read_text().strip(), namespace="kv1-demo", transport="tcp")
        out = [bytearray(1 << 20) for _ in blocks]
        t = time.monotonic()
        sizes = reader.batch_get_into(keys, out)
        get_s = time.monotonic() - t
        exact = sum(hashlib.sha256(o).digest() == hashlib.sha256(blk).digest() for o, blk in zip(out, blocks, strict=True))
        print(f"read back from the surviving replica over tcp in {get_s * 1000:.0f} ms: "
              f"{sum(s is not None for s in sizes)}/{len(keys)} hits, {exact}/{len(keys)} byte-exact")
        client.close()
        reader.close()
    finally:
        for agent in agents:
            agent.kill()
        cleanup_pool(pool)


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
