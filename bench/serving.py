"""Serving: the Mooncake synthetic trace through PD with the pool, PD without it, and colocated engines.

One run, three deployments side by side on loopback, each started fresh
(store agent, sim engines, router as real processes) and fed the same trace by
``daybreak load``:

- ``pd+pool``: prefill and decode engines on the pool; the router looks the
  prompt up in the pool and skips prefill when the pool holds it all;
- ``pd-no-pool``: the same engines with ``--no-pool`` (engine-local prefix
  caches only); with no pool there is no path for KV from prefill to decode,
  so decode computes the prompt again (its own local cache helps);
- ``colocated``: the same number of engines in role ``both`` on the pool, the
  router sending each request to one of them (prefix affinity and load).

The trace is sampled by root block (``sample_by_root``: whole prefix trees kept,
so its reuse survives) and time-scaled: arrival times and every modelled
duration are multiplied by the same ``--time-scale``, so the deployments see
the trace's own load, faster. KV bytes per block are scaled down (stated in the
output); the cost model still charges the layout's real block size. The pool's
capacity in blocks also feeds an offline LRU replay of the same requests: the
hit rate the system should approach.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from daybreak.serving.load.lru import lru_bound
from daybreak.serving.load.trace import SYNTHETIC_TRACE, read_trace, sample_by_root
from daybreak.serving.prompt import TRACE_BLOCK_TOKENS
from daybreak.serving.sim.costmodel import CostModel as SimCost
from daybreak.testing.serving_stack import Stack

# Llama-3.1-8B's KV (the example layout), 512-token blocks as in the trace: 64 MiB per block.
MODEL_BLOCK_BYTES = 2 * 32 * 8 * 128 * 2 * TRACE_BLOCK_TOKENS
HIGH_WATERMARK = 0.9  # the agent's default: eviction starts at this fill fraction
CONFIGS = ("pd+pool", "pd-no-pool", "colocated")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--trace", type=Path, default=SYNTHETIC_TRACE, help="Mooncake-format trace")
    parser.add_argument("--sample", type=int, default=8, help="keep requests whose first block id %% N == 0")
    parser.add_argument("--max-requests", type=int, default=None, help="cap on the sampled requests")
    parser.add_argument("--time-scale", type=float, default=0.05,
                        help="multiplies arrival times and every modelled duration (0.05: 20x faster)")
    # Two and two: one decode process relaying every stream is CPU-bound on 2 cores (a 3 + 1 split, tried
    # on a busy machine, had a TTFT p50 of 1.7 s), which is Python's limit, not the model's.
    parser.add_argument("--prefill", type=int, default=2, help="prefill engines (colocated: prefill + decode)")
    parser.add_argument("--decode", type=int, default=2, help="decode engines")
    parser.add_argument("--queue-seconds", type=float, default=0.5,
                        help="router estimate of what one queued request costs (modelled seconds)")
    parser.add_argument("--block-bytes", type=int, default=16384,
                        help=f"KV bytes moved per 512-token block (the model's is {MODEL_BLOCK_BYTES})")
    parser.add_argument("--pool-blocks", type=int, default=2000, help="pool capacity in blocks")
    parser.add_argument("--local-cache-blocks", type=int, default=128,
                        help="engine-local (HBM) prefix cache per engine, in blocks")
    parser.add_argument("--only", choices=CONFIGS, action="append", help="run only these deployments")
    parser.add_argument("--json", type=Path, default=None, help="write every number here")
    parser.add_argument("--keep", type=Path, default=None, help="keep the logs in this directory")


def _stack(directory: Path, args: argparse.Namespace, name: str) -> Stack:
    stack = Stack(directory / name, block_tokens=TRACE_BLOCK_TOKENS, block_bytes=args.block_bytes,
                  time_scale=args.time_scale, engine_flags=["--local-cache-blocks", str(args.local_cache_blocks),
                                                # the trace holds prompts over 128k tokens
                                                "--max-model-len", "262144"])
    pool = name != "pd-no-pool"
    if pool:
        dram_mib = math.ceil(args.pool_blocks * args.block_bytes / HIGH_WATERMARK / (1 << 20))
        stack.add_agents(1, dram=f"{dram_mib}Mi")
    if name == "colocated":
        for _ in range(args.prefill + args.decode):
            stack.engine("both")
    else:
        for _ in range(args.prefill):
            stack.engine("prefill", pool=pool)
        for _ in range(args.decode):
            stack.engine("decode", pool=pool)
    stack.start_router(pool_lookup=pool, extra=router_weights(args))
    return stack


def router_weights(args: argparse.Namespace) -> list[str]:
    """The router's cost estimate from the sim engine's cost model, for 512-token blocks of the example model.

    A queued request is charged ``--queue-seconds``: about the mean prefill a request of this trace
    still computes at the pool's hit rate (6-7k tokens, ~0.7 s modelled).
    """
    cost = SimCost()
    compute = cost.prefill_seconds(TRACE_BLOCK_TOKENS, context=0)
    load = cost.load_seconds(blocks=1, block_bytes=MODEL_BLOCK_BYTES)
    return ["--compute-block-seconds", f"{compute:.6f}", "--load-block-seconds", f"{load:.6f}",
            "--queue-seconds", str(args.queue_seconds)]


def _load(address: str, trace: Path, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "daybreak", "load", "--url", f"http://{address}", "--trace", str(trace),
           "--time-scale", str(args.time_scale), "--json", str(out), "--quiet", "--max-concurrency", "512",
           "--duration", "3600"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, cwd="/")
    if not out.exists():
        raise RuntimeError(f"daybreak load failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    summary: dict[str, Any] = json.loads(out.read_text())
    return summary


def _fmt(value: Any, unit: str = "") -> str:
    if value is None:
        return "-"
    if unit == "ms":
        return f"{value * 1000:.1f}"
    if unit == "%":
        return f"{value:.1%}"
    return f"{value:.1f}"


def run(args: argparse.Namespace) -> int:
    requests = sample_by_root(read_trace(args.trace), every=args.sample)[:args.max_requests]
    bound = lru_bound(requests, capacity_blocks=args.pool_blocks)
    unbounded = lru_bound(requests, capacity_blocks=10**12)
    span = (requests[-1].timestamp_ms - requests[0].timestamp_ms) / 1000
    print(f"trace {args.trace.name}: {len(requests)} requests (first block id % {args.sample} == 0) over "
          f"{span:.0f} s, replayed at time scale {args.time_scale} ({span * args.time_scale:.0f} s of arrivals); "
          f"{sum(r.input_length for r in requests)} prompt and {sum(r.output_length for r in requests)} output "
          "tokens", flush=True)
    print(f"deployments of {args.prefill + args.decode} sim engines ({args.prefill} prefill + {args.decode} decode, "
          f"or {args.prefill + args.decode} colocated); KV per 512-token block scaled from {MODEL_BLOCK_BYTES} to "
          f"{args.block_bytes} bytes; pool {args.pool_blocks} blocks, engine-local {args.local_cache_blocks} "
          "blocks per engine", flush=True)
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="daybreak-bench-serving-") as tmp:
        directory = args.keep or Path(tmp)
        trace = directory / "trace.jsonl"
        directory.mkdir(parents=True, exist_ok=True)
        trace.write_text("".join(json.dumps({"timestamp": r.timestamp_ms, "input_length": r.input_length,
                                             "output_length": r.output_length, "hash_ids": list(r.hash_ids)})
                                 + "\n" for r in requests))
        for name in args.only or CONFIGS:
            started = time.monotonic()
            stack = _stack(directory, args, name)
            try:
                assert stack.router is not None
                results[name] = _load(stack.router.address, trace, args, directory / f"{name}.json")
            finally:
                stack.close()
            s = results[name]
            print(f"  {name}: {s['completed_requests']}/{s['requests']} ok in {time.monotonic() - started:.0f} s",
                  flush=True)
    header = f"{'deployment':<12} {'ok':>5} {'failed':>6} {'TTFT p50 ms':>11} {'TTFT p90 ms':>11} " \
             f"{'ITL p50 ms':>10} {'out tok/s':>9} {'hit rate':>8}"
    print("\n" + header)
    for name, s in results.items():
        print(f"{name:<12} {s['completed_requests']:>5} {s['failed_requests']:>6} {_fmt(s['ttft_p50_s'], 'ms'):>11} "
              f"{_fmt(s['ttft_p90_s'], 'ms'):>11} {_fmt(s['itl_p50_s'], 'ms'):>10} "
              f"{_fmt(s['output_tokens_per_s']):>9} {_fmt(s['hit_rate'], '%'):>8}")
    print(f"{'LRU bound':<12} {'':>5} {'':>6} {'':>11} {'':>11} {'':>10} {'':>9} {_fmt(bound.hit_rate, '%'):>8}"
          f"   (offline LRU of {args.pool_blocks} blocks; unbounded cache: {_fmt(unbounded.hit_rate, '%')})")
    ratios: dict[str, dict[str, float | None]] = {}
    base = results.get("pd+pool")
    if base:
        for name, s in results.items():
            if name == "pd+pool":
                continue
            ratios[name] = {key: (s[key] / base[key]) if s.get(key) and base.get(key) else None
                            for key in ("ttft_p50_s", "ttft_p90_s", "itl_p50_s", "output_tokens_per_s")}
            r = ratios[name]
            print(f"{name} / pd+pool: TTFT p50 x{_fmt(r['ttft_p50_s'])}, TTFT p90 x{_fmt(r['ttft_p90_s'])}, "
                  f"ITL p50 x{_fmt(r['itl_p50_s'])}, throughput x{_fmt(r['output_tokens_per_s'])}")
        if bound.hit_rate and base.get("hit_rate") is not None:
            print(f"pd+pool hit rate {base['hit_rate']:.1%} = {base['hit_rate'] / bound.hit_rate:.0%} of the LRU bound")
    if args.json:
        args.json.write_text(json.dumps({
            "requests": len(requests), "sample": args.sample, "time_scale": args.time_scale,
            "block_bytes": args.block_bytes, "model_block_bytes": MODEL_BLOCK_BYTES, "pool_blocks": args.pool_blocks,
            "local_cache_blocks": args.local_cache_blocks, "prefill": args.prefill, "decode": args.decode,
            "lru_bound_hit_rate": bound.hit_rate, "unbounded_hit_rate": unbounded.hit_rate,
            "results": results, "ratios_vs_pd_pool": ratios}, indent=2) + "\n")
    failed = sum(s["failed_requests"] for s in results.values())
    return 0 if failed == 0 else 1
