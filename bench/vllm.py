"""vLLM benchmark: TTFT of a repeated long prompt on a second engine, Daybreak connector vs none vs the file connector.

vLLM runs on CPU (``make vllm-env``) with a locally built random-weight
Llama (~111 M parameters, so prefill dominates TTFT). Each prompt is first
served by engine A; engine B, a separate process pinned to the other core,
then serves it again and its time to first token is measured:

- ``none``: no connector, B computes the whole prompt (the cold cost);
- ``daybreak``: B loads the prompt's blocks from a standalone Daybreak pool;
- ``file``: B loads them through vLLM's in-tree example shared-storage connector
  (``ExampleConnector``, safetensors files under a directory).

Each case also reports B's own local prefix-cache hit (the same prompt a
second time on B), the target the issue sets: a hit from the pool within
1.2x of it. The Daybreak case reports load time per block from the
connector's ``event=loaded`` log lines. Engines are pinned with
``VLLM_CPU_OMP_THREADS_BIND`` (A on core 0, B on core 1) so cases compare.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import statistics
import subprocess
import tempfile
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from daybreak.testing.vllm_server import VllmServer, daybreak_transfer_config

_LOADED = re.compile(r"event=loaded blocks=(\d+) failed=(\d+) bytes=(\d+) seconds=([0-9.]+)")


@dataclass
class CaseResult:
    name: str
    cold_ttft: list[float] = field(default_factory=list)
    """A computing each prompt (nothing cached anywhere)."""
    hit_ttft: list[float] = field(default_factory=list)
    """B serving a prompt A served (from the connector, or computed again for ``none``)."""
    local_ttft: list[float] = field(default_factory=list)
    """B serving the same prompt again (its own prefix cache)."""
    cached_tokens: list[int] = field(default_factory=list)
    load_seconds_per_block: list[float] = field(default_factory=list)
    load_bytes_per_block: int = 0

    def summary(self) -> dict[str, Any]:
        def med(xs: list[float]) -> float:
            return statistics.median(xs) if xs else float("nan")

        return {"cold_ttft_s": med(self.cold_ttft), "second_engine_ttft_s": med(self.hit_ttft),
                "local_hit_ttft_s": med(self.local_ttft), "cached_tokens": self.cached_tokens,
                "load_ms_per_block": med(self.load_seconds_per_block) * 1e3 if self.load_seconds_per_block else None,
                "load_bytes_per_block": self.load_bytes_per_block or None}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prompts", type=int, default=3, help="distinct long prompts per case (median reported)")
    parser.add_argument("--prompt-tokens", type=int, default=1500, help="tokens per prompt")
    parser.add_argument("--model-dir", type=Path, default=None,
                        help="where the ~111 M-parameter model is built (default: a temporary directory)")
    parser.add_argument("--cases", default="none,daybreak,file", help="comma list of none, daybreak, file")
    parser.add_argument("--json", help="write all results to this file")


def _engines(python: Path, model: Path, work: Path, name: str,
             config: dict[str, Any] | None) -> tuple[VllmServer, VllmServer]:
    from daybreak.testing.store_agent import free_port

    def server(label: str, cpu: int) -> VllmServer:
        return VllmServer(python=python, model=model, port=free_port(), cpu=cpu, log_path=work / f"{name}-{label}.log",
                          kv_transfer_config=config, kv_cache_bytes=512 << 20)

    return server("a", 0), server("b", 1)


def _run_case(name: str, a: VllmServer, b: VllmServer, prompts: list[list[int]]) -> CaseResult:
    result = CaseResult(name)
    a.start()
    b.start()
    try:
        a.wait_ready(timeout_seconds=600)
        b.wait_ready(timeout_seconds=600)
        # One-off costs stay out of the figures: first forward passes, and for a connector B's first load
        # (the client maps and pre-faults the agent's shared-memory segment once per process).
        warm = [random.Random(-1).randrange(10, 4000) for _ in range(300)]
        a.complete(warm, max_tokens=2)
        b.complete(warm, max_tokens=2)
        skip_loads = len(_LOADED.findall(b.log_text()))
        for prompt in prompts:
            result.cold_ttft.append(a.complete(prompt, max_tokens=1).ttft_seconds)
            hit = b.complete(prompt, max_tokens=1)
            result.hit_ttft.append(hit.ttft_seconds)
            result.cached_tokens.append(hit.cached_tokens)
            result.local_ttft.append(b.complete(prompt, max_tokens=1).ttft_seconds)
            print(f"  {name}: cold {result.cold_ttft[-1]:.3f} s, second engine {hit.ttft_seconds:.3f} s "
                  f"({hit.cached_tokens} cached tokens), its local hit {result.local_ttft[-1]:.3f} s", flush=True)
        for match in _LOADED.findall(b.log_text())[skip_loads:]:
            blocks, failed, size, seconds = int(match[0]), int(match[1]), int(match[2]), float(match[3])
            if blocks and not failed:
                result.load_seconds_per_block.append(seconds / blocks)
                result.load_bytes_per_block = size // blocks
    finally:
        a.stop()
        b.stop()
    return result


def run(args: argparse.Namespace) -> int:
    from daybreak.devenv import vllmenv
    from daybreak.testing.store_agent import LocalAgent, cleanup_pool, free_port

    python = vllmenv.find()
    if python is None:
        print("error: the vLLM environment is not installed: run `make vllm-env` (`make bench` runs it)")
        return 1
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = set(cases) - {"none", "daybreak", "file"}
    if unknown:
        print(f"error: unknown cases {sorted(unknown)}; choose from none, daybreak, file")
        return 2
    rng = random.Random(7)
    results: dict[str, CaseResult] = {}
    with tempfile.TemporaryDirectory(prefix="daybreak-bench-vllm-") as tmp:
        work = Path(tmp)
        model = args.model_dir or work / "model"
        print(f"building the ~111 M-parameter model in {model} ...", flush=True)
        subprocess.run([str(python), "-m", "daybreak.testing.tinymodel", "--out", str(model), "--shape", "bench"],
                       check=True, env={"HF_HUB_OFFLINE": "1", "PYTHONSAFEPATH": "1", "PATH": "/usr/bin:/bin"},
                       stdout=subprocess.DEVNULL)
        pool_name = f"bv{uuid.uuid4().hex[:8]}"
        agent = LocalAgent(address=f"127.0.0.1:{free_port()}", token_file=work / "token", pool=pool_name, dram="2Gi",
                           log_path=work / "agent.log")
        agent.start()
        try:
            for case in cases:
                # Fresh prompts per case: nothing one case cached can help another.
                prompts = [[rng.randrange(10, 4000) for _ in range(args.prompt_tokens)] for _ in range(args.prompts)]
                config: dict[str, Any] | None = None
                if case == "daybreak":
                    config = daybreak_transfer_config(role="kv_both", endpoints=[agent.address],
                                                      token_file=agent.token_file, namespace="bench")
                elif case == "file":
                    storage = work / "file-connector"
                    storage.mkdir()
                    config = {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
                              "kv_connector_extra_config": {"shared_storage_path": str(storage)}}
                print(f"case {case}: starting two engines ...", flush=True)
                a, b = _engines(python, model, work, case, config)
                results[case] = _run_case(case, a, b, prompts)
        finally:
            agent.stop()
            cleanup_pool(pool_name)
    report = {name: r.summary() for name, r in results.items()}
    print(f"\nTTFT of a repeated {args.prompt_tokens}-token prompt on a second engine "
          f"(median of {args.prompts}; 111 M model, one core each)")
    print(f"{'case':10} {'cold (A)':>10} {'second engine':>14} {'its local hit':>14} {'hit/local':>10} "
          f"{'load/block':>11}")
    for name, s in report.items():
        ratio = s["second_engine_ttft_s"] / s["local_hit_ttft_s"] if s["local_hit_ttft_s"] else float("nan")
        load = f"{s['load_ms_per_block']:.2f} ms" if s["load_ms_per_block"] is not None else "-"
        print(f"{name:10} {s['cold_ttft_s']:>9.3f}s {s['second_engine_ttft_s']:>13.3f}s "
              f"{s['local_hit_ttft_s']:>13.3f}s {ratio:>9.2f}x {load:>11}")
    if "daybreak" in report and report["daybreak"]["load_bytes_per_block"]:
        print(f"daybreak block = {report['daybreak']['load_bytes_per_block'] / (1 << 20):.1f} MiB (all layers)")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0
