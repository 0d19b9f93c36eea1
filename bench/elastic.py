"""Elastic: a 1x -> 4x -> 1x load step against the SLA planner, fixed average-sized and fixed peak-sized replicas.

One local cluster (real control plane, kwok nodes, the process kubelet
running agents, sim engines and routers as real processes) and one operator;
three PDDeployments, one after the other, on the same KVPool and fed the same
``daybreak load`` sessions (same seed) whose rate steps 1x -> 4x -> 1x:

- ``planner``: autoscaling on, starting at 1 prefill + 1 decode (min 1, max 4);
- ``fixed-avg``: autoscaling off, replicas sized for the mean rate;
- ``fixed-peak``: autoscaling off, replicas sized for the 4x peak.

Both fixed sizings come from one model (``model_replicas``): the planner's own
formulas fed with the sim cost model's true numbers instead of learned ones,
rounded up. The targets are what a user of this cost model would set: TTFT 4 s
is about four times one request's bare prefill (320 uncached tokens x 3 ms =
0.96 s), so queueing may add up to three service times; ITL 80 ms is the cost
model's step time at batch 5 (20 ms + 12 ms per sequence), and the pods hold at
most four sequences (MAX_BATCH), so a pod past its capacity queues the excess.
(The earlier 45 ms sat one batch step above the 32 ms batch-1 ITL: no decode
pod could batch, and every fit noise said the target was out of reach.)

Measured per configuration: the share of requests meeting the TTFT target,
the ITL target (the request's mean inter-token gap) and both (a failed
request meets neither); engine pod-seconds (prefill + decode ready replicas
sampled every second, held between samples, over the load's span; agents
and the router are the same in all three and left out); the planner's scale
events (Events with reason ``Autoscaled``); the reaction time per role (load
step to the first new pod Ready); and failed requests. Short planner
intervals and windows (as in tests/operator/test_elastic_e2e.py) keep the
whole run within a few minutes on 2 cores; they are printed with the table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml

from daybreak.serving.load.summary import RequestRecord

log = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parents[1]
NS = "bench-elastic"
CONFIGS = ("planner", "fixed-avg", "fixed-peak")
# The e2e test's slowed-down cost model: one pod per role serves the base rate within the targets, the 4x
# step needs two of each, so scaling shows on 2 cores. The same numbers size the fixed baselines (below).
TIME_SCALE = 2.0
PREFILL_PER_TOKEN_SECONDS = 0.0015
DECODE_PER_SEQUENCE_SECONDS = 0.006
# At most four sequences per pod (vLLM's max_num_seqs): ITL at batch 4 is 68 ms, under the 80 ms target, so a
# pod past its capacity queues the excess (first tokens wait: TTFT, whose target has room) instead of slowing
# every running sequence past the ITL target (a batch of 19 at 250 ms when one decode pod took the 4x step).
MAX_BATCH = 4
ENGINE_ARGS = ["--time-scale", f"{TIME_SCALE:g}", "--prefill-per-token-seconds", f"{PREFILL_PER_TOKEN_SECONDS:g}",
               "--decode-per-sequence-seconds", f"{DECODE_PER_SEQUENCE_SECONDS:g}", "--max-batch", str(MAX_BATCH),
               "--drain-seconds", "20"]
TURNS, SYSTEM_TOKENS, USER_TOKENS, OUTPUT_TOKENS = 3, 128, 256, 64
LOAD_ARGS = ["--turns", str(TURNS), "--system-tokens", str(SYSTEM_TOKENS), "--user-tokens", str(USER_TOKENS),
             "--output-tokens", str(OUTPUT_TOKENS)]
# Prompt tokens a turn computes: its user message and the previous reply (the shared system prompt and the
# earlier turns are found in the pool). The planner measured 316-372 on this load.
UNCACHED_TOKENS = USER_TOKENS + OUTPUT_TOKENS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-rate", type=float, default=0.3, help="1x rate, requests/s")
    parser.add_argument("--base-seconds", type=float, default=40.0, help="1x phase before the step")
    parser.add_argument("--peak-seconds", type=float, default=40.0, help="4x phase")
    parser.add_argument("--after-seconds", type=float, default=80.0, help="1x phase after the step down")
    parser.add_argument("--peak-factor", type=float, default=4.0, help="the step's multiple of the base rate")
    parser.add_argument("--ttft", type=float, default=4.0,
                        help="TTFT target, seconds (about 4x one request's bare prefill, 320 tokens x 3 ms)")
    parser.add_argument("--itl", type=float, default=0.08,
                        help="ITL target, seconds (the cost model's ITL at batch 5: 20 ms + 5 x 12 ms)")
    parser.add_argument("--interval", type=float, default=3.0, help="planner interval, seconds")
    parser.add_argument("--up-window", type=float, default=3.0, help="scale-up stabilisation, seconds")
    parser.add_argument("--down-window", type=float, default=20.0, help="scale-down stabilisation, seconds")
    parser.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated subset of " + ",".join(CONFIGS))
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    parser.add_argument("--keep", action="store_true", help="keep the cluster directory (logs) afterwards")


# ---- pure parts (unit-tested) --------------------------------------------------------------------------------


def request_itl(record: RequestRecord) -> float | None:
    """A request's mean inter-token gap; None when it streamed fewer than two tokens."""
    return sum(record.itl_s) / len(record.itl_s) if record.itl_s else None


def slo_share(records: Sequence[RequestRecord], *, ttft: float, itl: float) -> dict[str, float | None]:
    """Shares of all requests meeting the TTFT target, the ITL target and both; a failed one meets neither."""
    if not records:
        return {"ttft": None, "itl": None, "both": None}
    n_ttft = n_itl = n_both = 0
    for r in records:
        ok_ttft = r.ok and r.ttft_s is not None and r.ttft_s <= ttft
        gap = request_itl(r)
        ok_itl = r.ok and (gap is None or gap <= itl)
        n_ttft += ok_ttft
        n_itl += ok_itl
        n_both += ok_ttft and ok_itl
    return {"ttft": n_ttft / len(records), "itl": n_itl / len(records), "both": n_both / len(records)}


def pod_seconds(samples: Sequence[tuple[float, int]], *, start: float, end: float) -> float:
    """Integrate a sampled pod count over [start, end], each sample's count held until the next one.

    Before the first sample the first count holds (the span starts with the pods the setup made ready).
    """
    if end <= start or not samples:
        return 0.0
    ordered = sorted(samples)
    total = 0.0
    count = ordered[0][1]
    t = start
    for at, n in ordered:
        if at <= start:
            count = n
            continue
        if at >= end:
            break
        total += count * (at - t)
        t, count = at, n
    return total + count * (end - t)


def reaction(samples: Sequence[tuple[float, int]], *, step: float) -> float | None:
    """Seconds from ``step`` to the first sample with more ready pods than at the step; None if none came."""
    before = [n for at, n in samples if at <= step]
    level = before[-1] if before else (samples[0][1] if samples else 0)
    return next((at - step for at, n in samples if at > step and n > level), None)


def model_replicas(rate: float, *, ttft: float, itl: float) -> tuple[int, int]:
    """(prefill, decode) pods for ``rate`` requests/s from the sim's cost model and the planner's own sizing.

    The fixed baselines are sized with what the planner would conclude if it knew the cost model exactly:
    prefill S = uncached tokens x per-token cost, pods = rate x S / (1 - S / TTFT target); decode ITL =
    a + c x batch from the cost model's step time, pods = tokens/s x ITL target / largest batch in target.
    Rounded up, at least one.
    """
    from daybreak.operator.planner import decode_pods, prefill_pods
    from daybreak.serving.sim.costmodel import CostModel

    cost = CostModel(time_scale=TIME_SCALE, prefill_per_token_seconds=PREFILL_PER_TOKEN_SECONDS,
                     decode_per_sequence_seconds=DECODE_PER_SEQUENCE_SECONDS)
    service = cost.prefill_seconds(UNCACHED_TOKENS, context=SYSTEM_TOKENS)
    prefill, _, _ = prefill_pods(rate=rate, uncached=UNCACHED_TOKENS, throughput=UNCACHED_TOKENS / service,
                                 target=ttft)
    context = SYSTEM_TOKENS + TURNS * (USER_TOKENS + OUTPUT_TOKENS) // 2  # a sequence's mean context
    one = cost.decode_seconds(batch=1, context_tokens=context)
    slope = cost.decode_seconds(batch=2, context_tokens=2 * context) - one
    decode, _ = decode_pods(tokens=rate * OUTPUT_TOKENS, queued=0.0, a=one - slope, c=slope, target=itl,
                            max_batch=MAX_BATCH)
    return max(1, math.ceil(prefill - 1e-9)), max(1, math.ceil(decode - 1e-9))


# ---- the run -------------------------------------------------------------------------------------------------


def pdd_manifest(name: str, *, replicas: tuple[int, int], autoscaling: dict[str, Any]) -> dict[str, Any]:
    """The elastic PDDeployment (this cost model, bounds 1..4 per role) on KVPool ``pool``; shared with the e2e test."""
    return {
        "apiVersion": "daybreak.dev/v1alpha1", "kind": "PDDeployment", "metadata": {"name": name},
        "spec": {
            "poolRef": {"name": "pool"},
            # A small layout (1 KiB blocks) so the KV bytes moved stay cheap on 2 cores.
            "model": {"name": "sim-model", "revision": "r1",
                      "kvLayout": {"numLayers": 2, "numKVHeads": 1, "headDim": 8, "dtype": "float16",
                                   "blockTokens": 16}},
            "engine": {"kind": "sim", "args": ENGINE_ARGS},
            "prefill": {"replicas": replicas[0], "minReplicas": 1, "maxReplicas": 4},
            "decode": {"replicas": replicas[1], "minReplicas": 1, "maxReplicas": 4},
            "autoscaling": autoscaling,
            "router": {"cacheStatistics": True},  # the load's hit rate reads cached_tokens
        }}


@dataclass
class Sample:
    t: float
    prefill_ready: int
    decode_ready: int


@dataclass
class Bench:
    """One cluster, one operator; ``run_config`` deploys, loads, measures and removes one PDDeployment."""

    args: argparse.Namespace
    cluster: Any
    api: httpx.Client
    workdir: Path
    samples: list[Sample] = field(default_factory=list)

    def get(self, path: str) -> dict[str, Any]:
        resp = self.api.get(path)
        resp.raise_for_status()
        return dict(resp.json())

    def ready(self, name: str, role: str) -> int:
        d = self.get(f"/apis/apps/v1/namespaces/{NS}/deployments/{name}-{role}")
        return int((d.get("status") or {}).get("readyReplicas") or 0)

    def pods(self, name: str) -> list[dict[str, Any]]:
        items = self.get(f"/api/v1/namespaces/{NS}/pods")["items"]
        return [p for p in items if p["metadata"]["name"].startswith(f"{name}-")]

    def router_url(self, name: str) -> str | None:
        for p in self.pods(name):
            labels = p["metadata"].get("labels") or {}
            conds = (p.get("status") or {}).get("conditions") or []
            if labels.get("daybreak.dev/role") == "router" and any(
                    c.get("type") == "Ready" and c.get("status") == "True" for c in conds):
                return f"http://{p['status']['podIP']}:8000"
        return None

    def wait(self, what: str, probe: Callable[[], Any], *, timeout: float = 240.0) -> Any:
        from daybreak.testing import e2e

        try:
            return e2e.wait_for(what, probe, timeout=timeout, interval=0.5, diagnose=lambda: f"logs in {self.workdir}")
        except e2e.WaitTimeout as exc:
            raise SystemExit(f"bench elastic: {exc}") from None

    def sample(self, name: str, stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                self.samples.append(Sample(time.monotonic(), self.ready(name, "prefill"), self.ready(name, "decode")))
            except (httpx.HTTPError, KeyError):
                pass
            stop.wait(1.0)

    def deploy(self, name: str, *, autoscale: bool, replicas: tuple[int, int]) -> None:
        a = self.args
        self.cluster.kubectl("apply", "-n", NS, "-f", "-", stdin=yaml.safe_dump(pdd_manifest(
            name, replicas=replicas, autoscaling={
                "enabled": autoscale, "ttftSeconds": a.ttft, "itlSeconds": a.itl, "intervalSeconds": a.interval,
                "scaleUpStabilizationSeconds": a.up_window, "scaleDownStabilizationSeconds": a.down_window})))

    def load(self, url: str, records: list[RequestRecord]) -> dict[str, Any]:
        from daybreak.serving.load import add_arguments as load_arguments
        from daybreak.serving.load import run_load

        a = self.args
        total = a.base_seconds + a.peak_seconds + a.after_seconds
        expected = a.base_rate * (a.base_seconds + a.peak_factor * a.peak_seconds + a.after_seconds)
        parser = argparse.ArgumentParser()
        load_arguments(parser)
        ns = parser.parse_args([
            "--url", url, "--sessions", str(int(expected) + 20), "--rate", str(a.base_rate),
            "--rate-steps", f"1x:{a.base_seconds}s,{a.peak_factor}x:{a.peak_seconds}s,1x:{a.after_seconds}s",
            "--duration", str(total), "--seed", "7", "--request-timeout", "120", "--quiet", *LOAD_ARGS])
        return asyncio.run(run_load(ns, records=records))

    def run_config(self, config: str) -> dict[str, Any]:
        a = self.args
        name = f"el-{config}"
        mean = a.base_rate * (a.base_seconds + a.peak_factor * a.peak_seconds + a.after_seconds) / (
            a.base_seconds + a.peak_seconds + a.after_seconds)
        replicas = {"planner": (1, 1), "fixed-peak": model_replicas(a.base_rate * a.peak_factor, ttft=a.ttft, itl=a.itl),
                    "fixed-avg": model_replicas(mean, ttft=a.ttft, itl=a.itl)}[config]
        print(f"[{config}] deploying {replicas[0]} prefill + {replicas[1]} decode "
              f"(autoscaling {'on' if config == 'planner' else 'off'})", flush=True)
        self.deploy(name, autoscale=config == "planner", replicas=replicas)
        url = self.wait(f"{name}: router and {replicas} engines ready", lambda: all(
            self.ready(name, r) >= n for r, n in zip(("prefill", "decode"), replicas, strict=True))
            and self.router_url(name))
        self.samples = []
        stop = threading.Event()
        sampler = threading.Thread(target=self.sample, args=(name, stop), daemon=True)
        sampler.start()
        time.sleep(1.5)
        records: list[RequestRecord] = []
        start = time.monotonic()
        summary = self.load(url, records)
        end = time.monotonic()
        stop.set()
        sampler.join(timeout=5)
        step_up = start + a.base_seconds
        prefill = [(s.t, s.prefill_ready) for s in self.samples]
        decode = [(s.t, s.decode_ready) for s in self.samples]
        events = self.get(f"/api/v1/namespaces/{NS}/events?fieldSelector=involvedObject.name={name},"
                          "reason=Autoscaled")["items"]
        pdd = self.get(f"/apis/daybreak.dev/v1alpha1/namespaces/{NS}/pddeployments/{name}")
        result = {
            "config": config, "replicas_at_start": list(replicas),
            "requests": len(records), "failed_requests": sum(1 for r in records if not r.ok),
            "slo": slo_share(records, ttft=a.ttft, itl=a.itl),
            "pod_seconds": pod_seconds([(t, p + d) for (t, p), (_, d) in zip(prefill, decode, strict=True)],
                                       start=start, end=end),
            "span_s": end - start,
            "peak_ready": {"prefill": max((n for _, n in prefill), default=0),
                           "decode": max((n for _, n in decode), default=0)},
            "reaction_s": {"prefill": reaction(prefill, step=step_up), "decode": reaction(decode, step=step_up)},
            "scale_events": sum(int(e.get("count") or 1) for e in events),
            "events": [e.get("message") for e in events],
            "last_scale": (pdd.get("status") or {}).get("lastScale"),
            "ttft_p90_s": summary.get("ttft_p90_s"), "itl_p50_s": summary.get("itl_p50_s"),
            "blocks_corrupt": summary.get("blocks_corrupt"), "errors": summary.get("errors"),
            "timeline": [[round(s.t - start, 1), s.prefill_ready, s.decode_ready] for s in self.samples],
            # Per request (sent at, ok, TTFT, mean ITL): the shares can be recomputed for other targets.
            "records": [[round(r.sent_at - start, 2), r.ok, r.ttft_s, request_itl(r)] for r in records],
        }
        print(f"[{config}] {json.dumps({k: result[k] for k in ('requests', 'failed_requests', 'slo', 'pod_seconds', 'reaction_s', 'scale_events')})}",
              flush=True)
        self.cluster.kubectl("delete", "-n", NS, "pddeployment", name, "--wait=false")
        self.wait(f"{name}: pods gone", lambda: not self.pods(name), timeout=180)
        return result


def _fmt(v: Any, spec: str = ".2f") -> str:
    return "-" if v is None else format(v, spec)


def table(results: dict[str, dict[str, Any]]) -> str:
    rows = [("config", "requests", "failed", "TTFT ok", "ITL ok", "both ok", "pod-s", "peak pods P/D",
             "react P/D s", "scale ev")]
    for c, r in results.items():
        rows.append((c, str(r["requests"]), str(r["failed_requests"]), _fmt(r["slo"]["ttft"], ".1%"),
                     _fmt(r["slo"]["itl"], ".1%"), _fmt(r["slo"]["both"], ".1%"), _fmt(r["pod_seconds"], ".0f"),
                     f"{r['peak_ready']['prefill']}/{r['peak_ready']['decode']}",
                     f"{_fmt(r['reaction_s']['prefill'], '.0f')}/{_fmt(r['reaction_s']['decode'], '.0f')}",
                     str(r["scale_events"])))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)) for row in rows)


def ratios(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The planner against each fixed sizing: SLO attainment (both targets) and pod-seconds."""
    out: dict[str, Any] = {}
    p = results.get("planner")
    for other in ("fixed-peak", "fixed-avg"):
        o = results.get(other)
        if not p or not o:
            continue
        out[f"planner_vs_{other}"] = {
            "slo_both": (p["slo"]["both"] / o["slo"]["both"]) if o["slo"]["both"] else None,
            "pod_seconds": p["pod_seconds"] / o["pod_seconds"] if o["pod_seconds"] else None,
        }
    peak = results.get("fixed-peak")
    if p and peak:
        out["target_met"] = bool(p["slo"]["both"] is not None and peak["slo"]["both"] is not None
                                 and p["slo"]["both"] >= peak["slo"]["both"]
                                 and p["pod_seconds"] <= 0.7 * peak["pod_seconds"] and p["failed_requests"] == 0)
    return out


def _stop(signum: int, _frame: Any) -> None:
    raise SystemExit(f"bench elastic: stopped by signal {signum}")


def run(args: argparse.Namespace) -> int:
    from daybreak.devenv.cluster import ClusterSpec, LocalCluster
    from daybreak.testing import e2e
    from daybreak.testing.operator_process import OperatorProcess

    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown or not configs:
        raise SystemExit(f"--configs: unknown {unknown}; choose from {', '.join(CONFIGS)}")
    # Not under /tmp: the process kubelet rewrites a pod's /tmp mount inside host paths that start with /tmp.
    base = Path.home() / ".cache" / "daybreak"
    base.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="bench-elastic-", dir=base))
    # A stop (TERM, or INT even where a background shell ignores it) unwinds through the cleanup below.
    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    began = time.monotonic()
    settings: dict[str, Any] = {k: getattr(args, k) for k in (
        "base_rate", "base_seconds", "peak_seconds", "after_seconds", "peak_factor", "ttft", "itl", "interval",
        "up_window", "down_window")}
    peak_rate = args.base_rate * args.peak_factor
    spans = (args.base_seconds, args.peak_seconds, args.after_seconds)
    mean_rate = args.base_rate * (spans[0] + args.peak_factor * spans[1] + spans[2]) / sum(spans)
    settings["fixed_peak_replicas"] = model_replicas(peak_rate, ttft=args.ttft, itl=args.itl)
    settings["fixed_avg_replicas"] = model_replicas(mean_rate, ttft=args.ttft, itl=args.itl)
    print(f"bench elastic: {json.dumps(settings)}; engine args {' '.join(ENGINE_ARGS)}; load {' '.join(LOAD_ARGS)}",
          flush=True)
    cluster = LocalCluster(workdir / "cluster", ClusterSpec(nodes=2, devices_per_node=8, process_kubelet=True),
                           progress=lambda m: print(f"  cluster: {m}", flush=True))
    results: dict[str, dict[str, Any]] = {}
    op: OperatorProcess | None = None
    try:
        cluster.start(timeout=300)
        cluster.kubectl("apply", "-f", str(ROOT / "crds"))
        cluster.kubectl("apply", "-f", "-", stdin=e2e.agent_rbac())
        cluster.kubectl("create", "namespace", NS)
        op = OperatorProcess(kubeconfig=cluster.kubeconfig, log_path=workdir / "operator.log", namespace=NS,
                             lease_namespace=NS, resync_seconds=30).start()
        cluster.kubectl("apply", "-n", NS, "-f", "-", stdin=yaml.safe_dump({
            "apiVersion": "daybreak.dev/v1alpha1", "kind": "KVPool", "metadata": {"name": "pool"},
            "spec": {"nodeSelector": {"daybreak.dev/accelerator": "sunrise"},
                     "tiers": {"dram": {"bytesPerNode": "256Mi"}}, "transport": {"preference": ["tcp"]}}}))
        with cluster.api() as api:
            bench = Bench(args, cluster, api, workdir)
            for config in configs:
                results[config] = bench.run_config(config)
    finally:
        if op is not None:
            op.stop()
        cluster.stop()
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
        else:
            print(f"logs kept in {workdir}")
    out = {"settings": settings, "results": results, "ratios": ratios(results),
           "wall_s": time.monotonic() - began}
    print()
    print(table(results))
    print(json.dumps(out["ratios"]))
    print(f"wall {out['wall_s']:.0f} s")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    return 0
