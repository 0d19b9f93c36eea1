"""Elastic PD end to end: `daybreak load` steps drive the planner on the local cluster with real sim engines.

The operator runs as a process against the full local stack; the process
kubelet runs the pool's agents, the sim engines and the router as real
processes. The load steps 1x -> 4x -> 1x through the router: the planner
must raise prefill and decode soon after the step, TTFT p90 must come back
under target once the new pods serve, a steady phase must change nothing, and
the step down must scale in only after the stabilisation window, with no
failed request, no corrupt block, and the victims' engine-local blocks handed
to the pool before they exit. Timing bounds are generous; the benchmark
(`daybreak bench elastic`) measures.
"""

from __future__ import annotations

import itertools
import json
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest

from daybreak.bench.elastic import LOAD_ARGS, model_replicas, pdd_manifest
from daybreak.devenv.cluster import LocalCluster
from daybreak.testing import e2e
from daybreak.testing.operator_process import OperatorProcess

pytestmark = pytest.mark.e2e

NS = "elastic-e2e"
T = TypeVar("T")

INTERVAL = 3
UP_WINDOW = 3
DOWN_WINDOW = 20
TTFT_TARGET = 4.0
# The cost model's ITL at batch 5 (20 ms + 5 x 12 ms), as bench/elastic.py: a decode pod may batch. (45 ms
# sat one batch step above the 32 ms batch-1 ITL: every noisy fit said the target was out of reach, decode
# went to its bound on the step and handed the surplus back just as the load stepped down.)
ITL_TARGET = 0.08
BASE_RATE = 0.3
# The cost model slowed down (prefill 3 ms per uncached token, ITL 20 ms + 12 ms per sequence in the batch)
# so that one pod of each role serves the base load (about 300 uncached prompt tokens and 64 output tokens
# per request) within the targets and the 4x step needs 2 of each: scaling shows on 2 cores. That cost model
# (ENGINE_ARGS), its load (LOAD_ARGS) and the PDDeployment are the benchmark's, so both measure one thing.


def wait_for(what: str, probe: Callable[[], T | None], *, timeout: float = 120.0, env: Env | None = None) -> T:
    return e2e.wait_for(what, probe, timeout=timeout, interval=0.5,
                        diagnose=(lambda: env.operator.log()[-4000:]) if env else None)


@dataclass
class Sample:
    t: float
    prefill: int
    decode: int
    prefill_ready: int
    decode_ready: int


@dataclass
class Env:
    space: e2e.E2ENamespace
    api: httpx.Client
    operator: OperatorProcess
    workdir: Path
    samples: list[Sample] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def get(self, path: str) -> dict[str, Any]:
        resp = self.api.get(path)
        resp.raise_for_status()
        return dict(resp.json())

    def deployment(self, role: str) -> dict[str, Any]:
        return self.get(f"/apis/apps/v1/namespaces/{NS}/deployments/elastic-{role}")

    def pdd(self) -> dict[str, Any]:
        return self.get(f"/apis/daybreak.dev/v1alpha1/namespaces/{NS}/pddeployments/elastic")

    def watch(self) -> None:
        """Record the role Deployments' replicas every half second (the planner's decisions as applied)."""
        while not self.stop.is_set():
            try:
                p, d = self.deployment("prefill"), self.deployment("decode")
                self.samples.append(Sample(time.monotonic(), int(p["spec"]["replicas"]), int(d["spec"]["replicas"]),
                                           int((p.get("status") or {}).get("readyReplicas") or 0),
                                           int((d.get("status") or {}).get("readyReplicas") or 0)))
            except (httpx.HTTPError, KeyError):
                pass
            self.stop.wait(0.5)

    def router_url(self) -> str:
        ready = self.space.ready_pods("daybreak.dev/role=router")
        return f"http://{ready[0]['status']['podIP']}:8000"

    def load(self, name: str, *, rate: float, seconds: float, seed: int) -> dict[str, Any]:
        """One `daybreak load` sessions run at ``rate`` requests/s for ``seconds``; returns its summary."""
        sessions = max(4, int(rate * seconds / 3) + 4)
        return e2e.run_load(self.router_url(), self.workdir / f"{name}.json",
                            ["--sessions", str(sessions), "--rate", str(rate), "--duration", str(seconds),
                             "--seed", str(seed), "--request-timeout", "120", *LOAD_ARGS], timeout=seconds + 180)

    def replicas_between(self, start: float, end: float) -> list[Sample]:
        return [s for s in self.samples if start <= s.t <= end]

    def timeline(self, origin: float) -> list[tuple[float, int, int]]:
        """The replicas whenever they changed, seconds from ``origin`` (for failure messages)."""
        out: list[tuple[float, int, int]] = []
        for s in self.samples:
            if not out or (s.prefill, s.decode) != out[-1][1:]:
                out.append((round(s.t - origin, 1), s.prefill, s.decode))
        return out

    def decisions(self) -> list[str]:
        """The operator's Autoscaled events as logged (wall time and message)."""
        return [line[11:23] + " " + line.split("message=", 1)[-1][:300] for line in self.operator.log().splitlines()
                if "reason=Autoscaled" in line]

    def engine_logs(self) -> str:
        return self.space.pod_logs("elastic-", tail=1 << 30)


@pytest.fixture(scope="module")
def env(cluster: LocalCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    workdir = tmp_path_factory.mktemp("elastic-e2e")
    space = e2e.E2ENamespace(cluster, NS).open()
    op = OperatorProcess(kubeconfig=cluster.kubeconfig, log_path=workdir / "operator.log", namespace=NS,
                         lease_namespace=NS, resync_seconds=30).start()
    e = Env(space, space.client, op, workdir)
    watcher = threading.Thread(target=e.watch, daemon=True)
    try:
        space.apply({
            "apiVersion": "daybreak.dev/v1alpha1", "kind": "KVPool", "metadata": {"name": "pool"},
            "spec": {"nodeSelector": {"daybreak.dev/accelerator": "sunrise"},
                     "tiers": {"dram": {"bytesPerNode": "256Mi"}}, "transport": {"preference": ["tcp"]}}},
            pdd_manifest("elastic", replicas=(1, 1), autoscaling={
                "enabled": True, "ttftSeconds": TTFT_TARGET, "itlSeconds": ITL_TARGET, "intervalSeconds": INTERVAL,
                "scaleUpStabilizationSeconds": UP_WINDOW, "scaleDownStabilizationSeconds": DOWN_WINDOW}))
        wait_for("the router and one engine per role ready", lambda: e.router_url() and all(
            int((e.deployment(r).get("status") or {}).get("readyReplicas") or 0) >= 1
            for r in ("prefill", "decode")), env=e, timeout=180)
        watcher.start()
        yield e
    finally:
        e.stop.set()
        op.stop()
        space.close()


@dataclass
class Phases:
    """What the scenario measured, shared by the checks below (they run in file order)."""

    results: dict[str, dict[str, Any]] = field(default_factory=dict)
    marks: dict[str, float] = field(default_factory=dict)


PHASES = Phases()




def test_a_steady_base_load_changes_nothing(env: Env) -> None:
    PHASES.marks["base"] = time.monotonic()
    PHASES.results["base"] = env.load("base", rate=BASE_RATE, seconds=30, seed=1)
    seen = env.replicas_between(PHASES.marks["base"] + 2 * INTERVAL, time.monotonic())
    assert seen and {(s.prefill, s.decode) for s in seen} == {(1, 1)}, seen[-5:]
    assert PHASES.results["base"]["failed_requests"] == 0, PHASES.results["base"]


def test_a_4x_step_raises_prefill_and_decode_and_ttft_comes_back_under_target(env: Env) -> None:
    step = time.monotonic()
    PHASES.marks["step_up"] = step
    PHASES.results["peak"] = env.load("peak", rate=4 * BASE_RATE, seconds=45, seed=2)
    up = env.replicas_between(step, time.monotonic())
    first_prefill = next((s.t for s in up if s.prefill > 1), None)
    first_decode = next((s.t for s in up if s.decode > 1), None)
    assert first_prefill is not None and first_decode is not None, (up[-5:], env.operator.log()[-3000:])
    # Generous: the step must first show in the engines' windows, then last the scale-up window. Decode gets
    # more: at an 80 ms target one pod meets it while its batch builds up after the step (measured first
    # decode scale-ups 29.8-32.5 s after the step; prefill 11.6-15.1 s; with the up window spanning the
    # lookback, 2026-12-01: decode 34.1 / 33.7 s, prefill 16.2 / 18.8 s; prefill 35.7 s with a second e2e
    # suite running beside this one on the 2 cores; with the backlog's urgent pod, 17:17: prefill 10.6 s,
    # decode 16.3 s). The benchmark measures reaction times; this bounds them.
    assert first_prefill - step < 45 and first_decode - step < 45, (first_prefill - step, first_decode - step)
    PHASES.marks["reaction_prefill"], PHASES.marks["reaction_decode"] = first_prefill - step, first_decode - step
    # Every pod asked for ready. Not "more than one" at this moment: no load runs during this wait, so
    # after the scale-down window the planner rightly hands pods back (a late third pod once took that long).
    wait_for("the new pods ready", lambda: env.samples[-1].prefill_ready >= env.samples[-1].prefill
             and env.samples[-1].decode_ready >= env.samples[-1].decode, env=env)
    settled = time.monotonic()
    PHASES.results["peak_settled"] = env.load("peak_settled", rate=4 * BASE_RATE, seconds=40, seed=3)
    result = PHASES.results["peak_settled"]
    assert result["failed_requests"] == 0, result
    assert result["ttft_p90_s"] < TTFT_TARGET, result
    # A steady (peak) phase once settled does not flap: it may still hand back an overshoot after the
    # scale-down window, but never grows again once it shrank.
    sizes = [(s.prefill, s.decode) for s in env.replicas_between(settled, time.monotonic())]
    for role in (0, 1):
        seq = [x[role] for x in sizes]
        shrunk = False
        for a, b in itertools.pairwise(seq):
            shrunk = shrunk or b < a
            assert not (shrunk and b > a), (env.timeline(step), env.decisions())


def test_a_step_down_scales_in_after_the_window_with_no_failure_and_no_lost_blocks(env: Env) -> None:
    peak = env.samples[-1]
    down = time.monotonic()
    down_wall = time.strftime("%H:%M:%S")
    result = env.load("after", rate=BASE_RATE, seconds=DOWN_WINDOW + 40, seed=4)
    PHASES.results["after"] = result
    seen = env.replicas_between(down, time.monotonic())
    first_in = next((s.t for s in seen if s.prefill < peak.prefill or s.decode < peak.decode), None)
    assert first_in is not None, (seen[-5:], env.operator.log()[-3000:])
    # Not before the window: inside it the planner's window still holds the peak's recommendations, so it
    # may hand back a pod the settled peak did not need (the backlog's urgent pod, say), but it never goes
    # below what the peak needs (the cost model's own sizing for 4x) because the load dropped.
    need = model_replicas(4 * BASE_RATE, ttft=TTFT_TARGET, itl=ITL_TARGET)
    early = [s for s in seen if s.t - down < DOWN_WINDOW - INTERVAL]
    if any(s.prefill < need[0] or s.decode < need[1] for s in early):  # the story, before the assert truncates it
        print(json.dumps({"first_in_s": first_in - down, "down": down_wall, "timeline": env.timeline(down),
                          "decisions": env.decisions()}, indent=1))
    assert all(s.prefill >= need[0] and s.decode >= need[1] for s in early), (need, first_in - down)
    below = next((s.t for s in seen if s.prefill < need[0] or s.decode < need[1]), None)
    assert below is not None and below - down >= DOWN_WINDOW - INTERVAL, (need, below)
    for name, r in PHASES.results.items():
        assert r["failed_requests"] == 0, (name, r)
        assert r["blocks_corrupt"] == 0, (name, r)
    # Every engine that was scaled in drained and handed its engine-local blocks to the pool.
    wait_for("the victims stopped", lambda: env.samples[-1].decode_ready == env.samples[-1].decode
             and env.samples[-1].prefill_ready == env.samples[-1].prefill, env=env)
    logs = env.engine_logs()
    handoffs = [line for line in logs.splitlines() if "event=handoff " in line]
    assert handoffs, logs[-3000:]
    assert all(line.rstrip().endswith("left=0") for line in handoffs), handoffs
    events = env.get(f"/api/v1/namespaces/{NS}/events?fieldSelector=involvedObject.name=elastic,"
                     "reason=Autoscaled")["items"]
    assert len(events) >= 3, [e["message"] for e in events]
    print(json.dumps({"marks": PHASES.marks, "results": {k: {m: v.get(m) for m in (
        "requests", "failed_requests", "ttft_p90_s", "itl_p50_s", "hit_rate")} for k, v in PHASES.results.items()},
        "events": [e["message"] for e in events]}, indent=1))


