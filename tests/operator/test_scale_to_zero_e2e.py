"""Scale to zero and back, end to end on the local cluster: planner, router hold queue, real sim engines.

The operator runs as a process against the full local stack; the process kubelet runs the pool's agents,
the sim engines and the router as real processes. A PDDeployment with ``minReplicas: 0`` on both roles
and short windows: after the down window with no traffic both roles reach zero (prefill first, decode
only once no prefill pod is left); a request then is held by the router, the planner starts both roles on
the router's held-requests gauge, and the request completes with 200. A prompt sent before the scale-in
is a pool hit after the cold start (the pool keeps the cache while the engines are at zero); a prompt
never seen before is not. Both first-token times (from sending, the hold included) are printed: this
bounds nothing on time, the numbers are for the report.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest

from daybreak.bench.elastic import pdd_manifest
from daybreak.devenv.cluster import LocalCluster
from daybreak.operator.engine_metrics import parse_router_backlog
from daybreak.testing import e2e
from daybreak.testing.operator_process import OperatorProcess

pytestmark = pytest.mark.e2e

NS = "zero-e2e"
NAME = "zero"
T = TypeVar("T")

INTERVAL = 2
DOWN_WINDOW = 10
# 40 prompt blocks of 16 byte-tokens: long enough that a pool hit is many blocks, short for 2 cores.
SEEN_PROMPT = "a system prompt the pool keeps while the engines sleep. " * 12
NEW_PROMPT = "an entirely different prompt, never sent before the cold start. " * 10


@dataclass
class Env:
    space: e2e.E2ENamespace
    operator: OperatorProcess
    workdir: Path
    numbers: dict[str, Any] = field(default_factory=dict)

    def get(self, path: str) -> dict[str, Any]:
        resp = self.space.client.get(path)
        resp.raise_for_status()
        return dict(resp.json())

    def replicas(self, role: str) -> int:
        return int(self.get(f"/apis/apps/v1/namespaces/{NS}/deployments/{NAME}-{role}")["spec"]["replicas"])

    def role_pods(self, role: str) -> list[dict[str, Any]]:
        return self.space.pods(f"daybreak.dev/role={role}")

    def router_url(self) -> str | None:
        ready = self.space.ready_pods("daybreak.dev/role=router")
        return f"http://{ready[0]['status']['podIP']}:8000" if ready else None

    def router_metrics(self) -> str:
        url = self.router_url()
        assert url is not None
        return httpx.get(f"{url}/metrics", timeout=10).text

    def diagnose(self) -> str:
        return self.operator.log()[-3000:] + "\n" + self.space.pod_logs(f"{NAME}-", tail=2500)


def wait_for(what: str, probe: Callable[[], T | None], *, env: Env, timeout: float = 180.0) -> T:
    return e2e.wait_for(what, probe, timeout=timeout, interval=0.5, diagnose=env.diagnose)


@pytest.fixture(scope="module")
def env(cluster: LocalCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    workdir = tmp_path_factory.mktemp("zero-e2e")
    space = e2e.E2ENamespace(cluster, NS).open()
    op = OperatorProcess(kubeconfig=cluster.kubeconfig, log_path=workdir / "operator.log", namespace=NS,
                         lease_namespace=NS, resync_seconds=30).start()
    e = Env(space, op, workdir)
    try:
        pdd = pdd_manifest(NAME, replicas=(1, 1), autoscaling={
            "enabled": True, "intervalSeconds": INTERVAL, "scaleUpStabilizationSeconds": INTERVAL,
            "scaleDownStabilizationSeconds": DOWN_WINDOW})
        pdd["spec"]["prefill"]["minReplicas"] = 0
        pdd["spec"]["decode"]["minReplicas"] = 0
        space.apply({
            "apiVersion": "daybreak.dev/v1alpha1", "kind": "KVPool", "metadata": {"name": "pool"},
            "spec": {"nodeSelector": {"daybreak.dev/accelerator": "sunrise"},
                     "tiers": {"dram": {"bytesPerNode": "256Mi"}}, "transport": {"preference": ["tcp"]}}}, pdd)
        wait_for("the router and one engine per role ready", lambda: e.router_url() and all(
            e.space.ready_pods(f"daybreak.dev/role={r}") for r in ("prefill", "decode")), env=e)
        yield e
    finally:
        print(json.dumps({"scale_to_zero": e.numbers}, indent=1))
        op.stop()
        space.close()


def first_token(url: str, prompt: str) -> tuple[float, dict[str, Any]]:
    """Send one streamed completion; (seconds from sending to its first token, the final usage)."""
    sent = time.monotonic()
    first: float | None = None
    usage: dict[str, Any] = {}
    body = {"prompt": prompt, "max_tokens": 4, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=300) as resp:
        assert resp.status_code == 200, resp.read()
        for line in resp.iter_lines():
            if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                continue
            chunk = json.loads(line[5:])
            if chunk.get("choices") and first is None:
                first = time.monotonic() - sent
            if isinstance(chunk.get("usage"), dict):
                usage = chunk["usage"]
    assert first is not None, "the stream ended without a token"
    return first, usage


def go_to_zero(env: Env) -> dict[str, float]:
    """Wait (sending nothing) until both roles are at zero; the order in which they got there."""
    start = time.monotonic()
    at_zero: dict[str, float] = {}

    def both_gone() -> bool:
        for role in ("prefill", "decode"):
            if role not in at_zero and env.replicas(role) == 0 and not env.role_pods(role):
                at_zero[role] = time.monotonic() - start
        return len(at_zero) == 2

    wait_for("both roles at zero replicas", both_gone, env=env, timeout=DOWN_WINDOW + 150)
    return at_zero


def cold_start(env: Env, prompt: str) -> tuple[float, dict[str, Any]]:
    """One request to a deployment at zero: it is held, the planner starts both roles, it completes."""
    url = env.router_url()
    assert url is not None, "the router must stay Ready at zero engines"
    assert parse_router_backlog(env.router_metrics()).held == 0.0
    try:
        seconds, usage = first_token(url, prompt)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{env.diagnose()}") from None
    assert env.replicas("prefill") >= 1 and env.replicas("decode") >= 1
    return seconds, usage


def test_with_no_traffic_both_roles_go_to_zero_prefill_first(env: Env) -> None:
    url = env.router_url()
    assert url is not None
    # A prompt served while the engines run: its blocks are in the pool when they go.
    warm, usage = first_token(url, SEEN_PROMPT)
    env.numbers["warm_first_token_s"] = round(warm, 3)
    env.numbers["warm_cached_tokens"] = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    at_zero = go_to_zero(env)
    env.numbers["to_zero_s"] = at_zero
    assert at_zero["prefill"] <= at_zero["decode"], at_zero


def test_a_request_at_zero_is_held_wakes_both_roles_and_its_prompt_is_a_pool_hit(env: Env) -> None:
    seconds, usage = cold_start(env, SEEN_PROMPT)
    env.numbers["cold_first_token_pool_hit_s"] = round(seconds, 3)
    cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    env.numbers["cold_pool_hit_cached_tokens"] = cached
    env.numbers["cold_pool_hit_prompt_tokens"] = usage.get("prompt_tokens")
    # The pool kept the prompt's blocks while no engine ran: all but the partial tail came from it.
    assert cached >= int(usage["prompt_tokens"]) - 16, usage
    metrics = env.router_metrics()
    assert parse_router_backlog(metrics).held == 0.0
    held = sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
               if line.startswith("daybreak_router_hold_seconds_count"))
    assert held >= 1, metrics
    assert "scale from zero" in env.operator.log(), env.diagnose()


def test_a_new_prompt_after_another_cold_start_is_computed(env: Env) -> None:
    env.numbers["to_zero_again_s"] = go_to_zero(env)
    seconds, usage = cold_start(env, NEW_PROMPT)
    env.numbers["cold_first_token_new_prompt_s"] = round(seconds, 3)
    cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    env.numbers["cold_new_prompt_cached_tokens"] = cached
    assert cached == 0, usage
