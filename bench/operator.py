"""Operator throughput: N PDDeployments on one KVPool, time until every child exists, latency, peak RSS.

Starts its own local control plane (etcd + kube-apiserver by default, so the
numbers are the operator's and the apiserver's, not the pod churn of
controller-manager and kwok; ``--full`` adds those), runs the real
``daybreak operator`` process, creates the pool, waits for it, then creates
the PDDeployments as fast as the apiserver takes them. Two watch streams
(Deployments, Services) stamp the moment each child appears; a deployment's
apply-to-children latency is from its create call returning to its last
child appearing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from daybreak.api import labels as vocab
from daybreak.api.metrics import OPERATOR_APISERVER_ERRORS, OPERATOR_RECONCILES, total
from daybreak.devenv.cluster import ClusterSpec, LocalCluster
from daybreak.testing.operator_process import OperatorProcess

PHASES = ("bench-burst", "bench-paced")
ROOT = Path(__file__).resolve().parent.parent
TARGETS = {"total_seconds": 60.0, "p50_seconds": 1.0, "rss_mb": 250.0}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--deployments", type=int, default=200, help="PDDeployments to create (default 200)")
    parser.add_argument("--workers", type=int, default=8, help="operator --workers (default 8)")
    parser.add_argument("--rate", type=float, default=10.0,
                        help="creates per second of the paced phase (default 10; the burst phase creates all at once)")
    parser.add_argument("--full", action="store_true",
                        help="also run controller-manager, scheduler and kwok (pods are created too)")
    parser.add_argument("--timeout", type=float, default=300.0, help="give up after this many seconds")
    parser.add_argument("--json", dest="json_out", help="also write the results as JSON to this file")


@dataclass
class _Seen:
    """First-seen time of every object name, fed by a watch thread."""

    times: dict[str, float] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)
    error: str | None = None


def _watch(cluster: LocalCluster, path: str, seen: _Seen, stop: threading.Event) -> None:
    while not stop.is_set():
        try:
            with cluster.api() as api, api.stream("GET", path, params={"watch": "1", "timeoutSeconds": "600"},
                                                  timeout=httpx.Timeout(30.0, read=None)) as resp:
                for line in resp.iter_lines():
                    if stop.is_set():
                        return
                    if not line:
                        continue
                    event = json.loads(line)
                    if event.get("type") == "ADDED":
                        name = event["object"]["metadata"]["name"]
                        with seen.lock:
                            seen.times.setdefault(name, time.monotonic())
        except (httpx.HTTPError, ValueError) as exc:
            seen.error = f"{type(exc).__name__}: {exc}"
            time.sleep(0.2)


def _pdd(name: str) -> dict[str, Any]:
    return {
        "apiVersion": vocab.API_VERSION, "kind": "PDDeployment", "metadata": {"name": name},
        "spec": {
            "poolRef": {"name": "bench-pool"},
            "model": {"name": "bench/model", "revision": name,
                      "kvLayout": {"numLayers": 32, "numKVHeads": 8, "headDim": 128}},
            "engine": {"kind": "sim"},
            "prefill": {"replicas": 1}, "decode": {"replicas": 1},
        },
    }


def _children(name: str) -> tuple[list[str], list[str]]:
    """(Deployments, Services) the operator creates for one PDDeployment named ``name``."""
    return [f"{name}-prefill", f"{name}-decode", f"{name}-router"], [f"{name}-prefill", f"{name}-decode", name]


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far."""
    import os

    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def run(args: argparse.Namespace) -> int:
    directory = Path(tempfile.mkdtemp(prefix="daybreak-bench-operator-"))
    spec = ClusterSpec(nodes=2, controllers=args.full, kwok=args.full)
    print(f"bench operator: starting a local control plane in {directory} "
          f"({'full stack' if args.full else 'etcd + kube-apiserver'})", flush=True)
    cluster = LocalCluster(directory / "cluster", spec, progress=lambda _m: None)
    with cluster:
        cluster.kubectl("apply", "-f", str(ROOT / "crds"))
        for phase in PHASES:
            cluster.kubectl("create", "namespace", phase)
        op = OperatorProcess(kubeconfig=cluster.kubeconfig, log_path=directory / "operator.log",
                             namespace=None, identity="bench", lease_namespace=PHASES[0],
                             resync_seconds=max(60.0, args.timeout),
                             extra_args=[f"--workers={args.workers}", "--log-level=WARNING"]).start()
        try:
            results = []
            for phase, rate in zip(PHASES, (0.0, args.rate), strict=True):
                result = _phase(cluster, op, args, namespace=phase, rate=rate)
                if result is None:
                    print(f"operator log: {op.log_path}")
                    return 1
                results.append(result)
                if phase != PHASES[-1]:
                    _tear_down(cluster, phase)
            results[-1]["rss_mb"] = results[0]["rss_mb"] = round(op.peak_rss_bytes() / 2**20, 1)
        finally:
            op.stop()
    _print(results, args)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(results, indent=2))
    print(f"(logs in {directory})")
    burst, paced = results
    ok = (burst["total_seconds"] < TARGETS["total_seconds"] and paced["p50_seconds"] < TARGETS["p50_seconds"]
          and burst["rss_mb"] < TARGETS["rss_mb"])
    return 0 if ok else 1


def _tear_down(cluster: LocalCluster, namespace: str) -> None:
    """Delete a phase's PDDeployments and Services: the local cluster's Service range (/24) holds ~250 ClusterIPs."""
    with cluster.api() as api:
        api.delete(f"/apis/{vocab.API_VERSION}/namespaces/{namespace}/{vocab.PDDEPLOYMENT_PLURAL}").raise_for_status()
        for svc in api.get(f"/api/v1/namespaces/{namespace}/services").json().get("items", []):
            api.delete(f"/api/v1/namespaces/{namespace}/services/{svc['metadata']['name']}")


def _phase(cluster: LocalCluster, op: OperatorProcess, args: argparse.Namespace, *, namespace: str,
           rate: float) -> dict[str, Any] | None:
    """Create the pool, then the PDDeployments (all at once when ``rate`` is 0, else ``rate`` per second)."""
    api = cluster.api()
    base = f"/apis/{vocab.API_VERSION}/namespaces/{namespace}"
    pool = {"apiVersion": vocab.API_VERSION, "kind": "KVPool", "metadata": {"name": "bench-pool"},
            "spec": {"tiers": {"dram": {"bytesPerNode": "1Gi"}}}}
    api.post(f"{base}/{vocab.KVPOOL_PLURAL}", json=pool).raise_for_status()
    deadline = time.monotonic() + args.timeout
    while api.get(f"/apis/apps/v1/namespaces/{namespace}/daemonsets/bench-pool-agent").status_code != 200:
        if time.monotonic() > deadline or not op.alive():
            print("the operator did not reconcile the pool")
            return None
        time.sleep(0.2)

    deployments, services, stop = _Seen(), _Seen(), threading.Event()
    for path, seen in ((f"/apis/apps/v1/namespaces/{namespace}/deployments", deployments),
                       (f"/api/v1/namespaces/{namespace}/services", services)):
        threading.Thread(target=_watch, args=(cluster, path, seen, stop), daemon=True).start()
    time.sleep(0.5)  # let both watches connect before the first create
    names = [f"pdd-{i:04d}" for i in range(args.deployments)]
    pids = {"operator": op.pid, **{k: v for k, v in cluster.pids().items() if k in ("kube-apiserver", "etcd")}}
    cpu_before = {k: _cpu_seconds(p) for k, p in pids.items()}
    reconciles_before = op.metric(total(OPERATOR_RECONCILES))
    created: dict[str, float] = {}
    started = time.monotonic()

    def create(name: str) -> None:
        r = api.post(f"{base}/{vocab.PDDEPLOYMENT_PLURAL}", json=_pdd(name))
        r.raise_for_status()
        created[name] = time.monotonic()

    if rate <= 0:
        # A burst from a few concurrent clients, like `kubectl apply -f dir/` from several terminals.
        with ThreadPoolExecutor(max_workers=4) as pool_exec:
            list(pool_exec.map(create, names))
    else:
        for i, name in enumerate(names):
            time.sleep(max(0.0, started + i / rate - time.monotonic()))
            create(name)
    created_all = time.monotonic() - started

    def done(name: str) -> float | None:
        deps, svcs = _children(name)
        with deployments.lock, services.lock:
            stamps = [deployments.times.get(d) for d in deps] + [services.times.get(s) for s in svcs]
        return None if any(s is None for s in stamps) else max(s for s in stamps if s is not None)

    finished: dict[str, float] = {}
    while len(finished) < len(names) and time.monotonic() < deadline:
        for name in names:
            if name not in finished and (t := done(name)) is not None:
                finished[name] = t
        time.sleep(0.1)
    stop.set()
    api.close()
    if len(finished) < len(names):
        print(f"only {len(finished)}/{len(names)} deployments got all children within {args.timeout:.0f}s")
        return None
    latencies = [finished[n] - created[n] for n in names]
    return {
        "mode": "burst" if rate <= 0 else f"{rate:g}/s", "deployments": len(names), "children": 6 * len(names),
        "stack": "full" if args.full else "apiserver", "workers": args.workers,
        "create_seconds": round(created_all, 2), "total_seconds": round(max(finished.values()) - started, 2),
        "p50_seconds": round(statistics.median(latencies), 3), "p99_seconds": round(_percentile(latencies, 0.99), 3),
        "max_seconds": round(max(latencies), 3), "rss_mb": 0.0,
        "reconciles": int(op.metric(total(OPERATOR_RECONCILES)) - reconciles_before),
        "apiserver_errors": int(op.metric(total(OPERATOR_APISERVER_ERRORS))),
        "cpu_seconds": {k: round(_cpu_seconds(p) - cpu_before[k], 1) for k, p in pids.items()},
    }


def _print(results: list[dict[str, Any]], args: argparse.Namespace) -> None:
    burst, paced = results
    print(f"\noperator: {burst['deployments']} PDDeployments x 6 children on one KVPool per namespace "
          f"({burst['stack']}, --workers={args.workers}); burst: all created at once "
          f"({burst['create_seconds']} s of creates), paced: {paced['mode']} into a second namespace\n")
    rows: list[tuple[str, str, str, str]] = [
        ("every child exists (s)", f"{burst['total_seconds']:.1f}", f"{paced['total_seconds']:.1f}",
         f"< {TARGETS['total_seconds']:.0f} (burst)"),
        ("apply-to-children p50 (s)", f"{burst['p50_seconds']:.3f}", f"{paced['p50_seconds']:.3f}",
         f"< {TARGETS['p50_seconds']:.0f} (paced)"),
        ("apply-to-children p99 (s)", f"{burst['p99_seconds']:.3f}", f"{paced['p99_seconds']:.3f}", ""),
        ("apply-to-children max (s)", f"{burst['max_seconds']:.3f}", f"{paced['max_seconds']:.3f}", ""),
        ("reconciles", str(burst["reconciles"]), str(paced["reconciles"]), ""),
        *((f"CPU {k} (s)", f"{burst['cpu_seconds'][k]:.1f}", f"{paced['cpu_seconds'][k]:.1f}", "")
          for k in burst["cpu_seconds"]),
        ("operator peak RSS (MB)", f"{burst['rss_mb']:.0f}", "", f"< {TARGETS['rss_mb']:.0f}"),
        ("apiserver errors", str(paced["apiserver_errors"]), "", ""),
    ]
    print("| metric | burst | paced | target |\n|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")
