"""The serving path end to end on the local cluster: a pool and a sim PDDeployment whose pods really run.

The operator (a real process) turns a KVPool and a PDDeployment with
``engine.kind: sim`` into agents, prefill and decode engines and a router; the
process kubelet runs them all on their own loopback addresses. Requests go to
the router's pod address like ``curl`` would; ``daybreak load`` drives it for a
bounded time. A tiny kvLayout (4 KiB blocks) keeps the KV traffic small enough
for 2 cores.
"""

from __future__ import annotations

import base64
import json
import os
import re
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest
import yaml

from daybreak.api.kvcompat import KVLayout
from daybreak.devenv.cluster import LocalCluster
from daybreak.pool.credentials import NAMESPACE, parse
from daybreak.pool.engine_secret import credential_secret_name
from daybreak.testing import e2e
from daybreak.testing.operator_process import OperatorProcess

pytestmark = pytest.mark.e2e

NS = "serve-e2e"
POOL = "kv-e2e"
PDD = "sim-e2e"
# 2 layers x 2 KV heads x head size 16, bf16, 16-token blocks: 4 KiB per block.
LAYOUT = {"numLayers": 2, "numKVHeads": 2, "headDim": 16, "blockTokens": 16}
BLOCK_TOKENS = LAYOUT["blockTokens"]
T = TypeVar("T")


def wait_for(what: str, probe: Callable[[], T | None], *, timeout: float = 120.0,
             on_fail: Callable[[], str] | None = None) -> T:
    return e2e.wait_for(what, probe, timeout=timeout, diagnose=on_fail)


@dataclass
class Serving:
    cluster: LocalCluster
    api: httpx.Client
    operator: OperatorProcess
    logs: Path

    def pods(self, role: str) -> list[dict[str, Any]]:
        body = self.api.get(f"/api/v1/namespaces/{NS}/pods",
                            params={"labelSelector": f"daybreak.dev/deployment={PDD},daybreak.dev/role={role}"}).json()
        return list(body.get("items") or [])

    def ready_pods(self, role: str) -> list[dict[str, Any]]:
        return [p for p in self.pods(role) if e2e.is_ready(p)]

    def router_url(self) -> str:
        (router,) = wait_for("one Ready router", lambda: (r := self.ready_pods("router")) and len(r) == 1 and r,
                             on_fail=self.diagnose)
        return f"http://{router['status']['podIP']}:8000"

    def engine_metrics(self) -> dict[str, float]:
        """Samples (``name{labels}``) summed over every Ready engine pod's /metrics."""
        totals: dict[str, float] = {}
        for role in ("prefill", "decode"):
            for pod in self.ready_pods(role):
                text = httpx.get(f"http://{pod['status']['podIP']}:8000/metrics", timeout=10).text
                for name, value in parse_counters(text).items():
                    totals[name] = totals.get(name, 0.0) + value
        return totals

    def load(self, *args: str, timeout: float = 240) -> dict[str, Any]:
        return e2e.run_load(self.router_url(), self.logs / f"load-{time.monotonic_ns()}.json", args, timeout=timeout)

    def diagnose(self) -> str:
        lines = [f"--- operator ---\n{self.operator.log()[-2000:]}"]
        for log in sorted((self.cluster.directory / "pods").glob(f"{NS}_*/*.log")):
            lines.append(f"--- {log.parent.name}/{log.name} ---\n{log.read_text(errors='replace')[-1500:]}")
        return "\n".join(lines)


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+([0-9.eE+-]+|NaN|\+Inf)$")


def parse_counters(text: str) -> dict[str, float]:
    """``name{labels} -> value`` for the sample lines of a Prometheus text page (model_name label dropped)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line.strip())
        if m and m.group(3) not in ("NaN", "+Inf"):
            labels = ",".join(x for x in (m.group(2) or "").strip("{}").split(",") if x and
                              not x.startswith("model_name="))
            out[f"{m.group(1)}{{{labels}}}"] = float(m.group(3))
    return out


def delta(after: dict[str, float], before: dict[str, float], key: str) -> float:
    return after.get(key, 0.0) - before.get(key, 0.0)


@pytest.fixture(scope="module")
def serving(cluster: LocalCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Serving]:
    assert cluster.kubelet is not None, "the serving path needs the process kubelet"
    logs = tmp_path_factory.mktemp("serving-e2e")
    ns = e2e.E2ENamespace(cluster, NS).open()
    api = ns.client
    operator = OperatorProcess(kubeconfig=cluster.kubeconfig, log_path=logs / "operator.log", namespace=NS,
                               identity="serving-e2e", lease_namespace=NS, resync_seconds=5.0)
    env = Serving(cluster, api, operator, logs)
    try:
        operator.start()
        pool = {"apiVersion": "daybreak.dev/v1alpha1", "kind": "KVPool", "metadata": {"name": POOL},
                "spec": {"nodeSelector": {"daybreak.dev/accelerator": "sunrise"},
                         "tiers": {"dram": {"bytesPerNode": "256Mi"}},
                         "transport": {"preference": ["shm", "tcp"]}}}
        pdd = {"apiVersion": "daybreak.dev/v1alpha1", "kind": "PDDeployment", "metadata": {"name": PDD},
               "spec": {"poolRef": {"name": POOL},
                        "model": {"name": "sim/tiny", "revision": "e2e", "kvLayout": LAYOUT},
                        # Modelled durations at a tenth: the test is about the path, not the timing. No
                        # engine-local prefix cache: every block a turn reuses must come through the pool.
                        "engine": {"kind": "sim", "args": ["--time-scale", "0.1", "--local-cache-blocks", "0"]},
                        "prefill": {"replicas": 1}, "decode": {"replicas": 2},
                        "router": {"cacheStatistics": True}}}  # the hit rates read cached_tokens
        cluster.kubectl("apply", "-n", NS, "-f", "-", stdin=yaml.safe_dump_all([pool, pdd]))
        wait_for("the PDDeployment Ready", lambda: any(
            c["type"] == "Ready" and c["status"] == "True" for c in (api.get(
                f"/apis/daybreak.dev/v1alpha1/namespaces/{NS}/pddeployments/{PDD}").json().get("status") or {}
            ).get("conditions") or []), timeout=240, on_fail=env.diagnose)
        yield env
    finally:
        operator.stop()
        # Waits until the agents are gone and deletes their KVNodes: a KVNode is per node, not per pool, so
        # a report of ours left behind would be summed into a later test's pool on the same nodes.
        ns.close()


def chat(url: str, messages: list[dict[str, str]], *, max_tokens: int = 8) -> dict[str, Any]:
    resp = httpx.post(f"{url}/v1/chat/completions", json={"model": "sim/tiny", "messages": messages,
                                                          "max_tokens": max_tokens}, timeout=60)
    assert resp.status_code == 200, resp.text
    return dict(resp.json())


def test_curl_on_the_routers_pod_address_streams_tokens(serving: Serving) -> None:
    """The issue's "done means": a streamed completion from the router's own loopback address."""
    url = serving.router_url()
    out = subprocess.run(["curl", "-sN", f"{url}/v1/completions", "-H", "Content-Type: application/json",
                          "-d", json.dumps({"model": "sim/tiny", "prompt": "Hello, pool! " * 20, "max_tokens": 6,
                                            "stream": True})],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    events = [line.removeprefix("data: ") for line in out.stdout.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]", out.stdout[-500:]
    chunks = [json.loads(e) for e in events[:-1]]
    text = "".join(c["choices"][0].get("text") or "" for c in chunks if c.get("choices"))
    assert sum(1 for c in chunks if c.get("choices") and c["choices"][0].get("text")) >= 2 and text


def test_engines_hold_their_kv_namespace_credential_minted_by_the_agents(serving: Serving) -> None:
    """Engine and router pods get the agent-minted credential of their kvNamespace, never the pool secret;
    the pool reads and writes of the tests below prove the agents accept it."""
    pod = serving.ready_pods("decode")[0]
    kv_ns = pod["metadata"]["annotations"]["daybreak.dev/kv-namespace"]
    name = credential_secret_name(PDD, kv_ns)
    for role in ("prefill", "decode", "router"):
        for p in serving.ready_pods(role):
            env = {e["name"]: e for e in p["spec"]["containers"][0]["env"]}
            assert env["DAYBREAK_POOL_TOKEN"]["valueFrom"]["secretKeyRef"]["name"] == name, (role, env)
    secret = serving.api.get(f"/api/v1/namespaces/{NS}/secrets/{name}").json()
    assert [o["name"] for o in secret["metadata"]["ownerReferences"]] == [PDD]
    credential = base64.b64decode(secret["data"]["token"]).decode()
    scope, _ = parse(credential)
    assert (scope.role, scope.namespace) == (NAMESPACE, kv_ns)
    pool_secret = serving.api.get(f"/api/v1/namespaces/{NS}/secrets/{POOL}-token").json()
    assert base64.b64decode(pool_secret["data"]["token"]).decode() not in credential


def test_the_second_turn_reads_its_shared_prefix_from_the_pool_checked_by_content(serving: Serving) -> None:
    url = serving.router_url()
    system = {"role": "system", "content": "You are a careful assistant. " * 30}
    first = [system, {"role": "user", "content": "Turn one: tell me about pooled KV caches."}]
    one = chat(url, first)
    answer = one["choices"][0]["message"]["content"]
    second = [*first, {"role": "assistant", "content": answer}, {"role": "user", "content": "And turn two?"}]
    two = chat(url, second)
    shared = (one["usage"]["prompt_tokens"] // BLOCK_TOKENS) * BLOCK_TOKENS
    ext = two["usage"]["daybreak"]
    # Turn one's prompt is a prefix of turn two's: its full blocks come from the pool (decode reads them there).
    assert ext["pool_hit_tokens"] >= shared, two["usage"]
    assert two["usage"]["prompt_tokens_details"]["cached_tokens"] >= shared - BLOCK_TOKENS, two["usage"]
    assert ext["bytes_read"] > 0 and ext["blocks_checked"] > 0 and ext["blocks_corrupt"] == 0
    assert one["usage"]["daybreak"]["bytes_written"] > 0


def test_load_through_the_router_succeeds_and_the_engines_agree_on_the_hit_rate(serving: Serving) -> None:
    before = serving.engine_metrics()
    summary = serving.load("--sessions", "8", "--turns", "3", "--rate", "4", "--system-tokens", "512",
                           "--user-tokens", "64", "--output-tokens", "8", "--duration", "60", "--seed", "1")
    after = serving.engine_metrics()
    assert summary["requests"] == 24 and summary["failed_requests"] == 0, summary.get("errors")
    assert summary["blocks_corrupt"] == 0 and summary["bytes_read"] > 0 and summary["bytes_written"] > 0
    assert summary["hit_rate"] > 0.3  # turns 2 and 3 repeat turn 1's prompt; every session shares the system
    # The engines' own counters tell the same story: what they computed, read and wrote is what the
    # router summed into each response and the load generator added up (so the hit rates agree).
    computed = delta(after, before, 'daybreak_engine_prompt_tokens_by_source_total{source="computed"}')
    assert computed == summary["computed_tokens"], (computed, summary)
    # The engines count decode's recomputed partial tail block as computed again; the usage counts a token
    # both steps computed once: the hit rates differ by at most that tail (under a block) per request.
    engine_hit_rate = 1 - computed / summary["prompt_tokens"]
    tails = summary["requests"] * BLOCK_TOKENS / summary["prompt_tokens"]
    assert engine_hit_rate <= summary["hit_rate"] <= engine_hit_rate + tails, (engine_hit_rate, summary["hit_rate"])
    assert delta(after, before, 'daybreak_engine_kv_bytes_total{direction="read"}') == summary["bytes_read"]
    assert delta(after, before, 'daybreak_engine_kv_bytes_total{direction="written"}') == summary["bytes_written"]
    pool_tokens = delta(after, before, 'daybreak_engine_prompt_tokens_by_source_total{source="pool"}')
    assert pool_tokens > 0
    # Decode checked every block it read by content, and none was wrong.
    block_bytes = KVLayout(num_layers=LAYOUT["numLayers"], num_kv_heads=LAYOUT["numKVHeads"],
                           head_dim=LAYOUT["headDim"], block_tokens=BLOCK_TOKENS).bytes_per_block
    assert delta(after, before, "daybreak_engine_blocks_checked_total{}") * block_bytes == summary["bytes_read"] > 0
    assert delta(after, before, "daybreak_engine_blocks_corrupt_total{}") == 0


def test_deleting_a_decode_pod_mid_load_loses_no_request(serving: Serving) -> None:
    out = serving.logs / "load-delete.json"
    load = subprocess.Popen([e2e.daybreak_command(), "load", "--url", serving.router_url(), "--quiet", "--json", str(out),
                             "--sessions", "12", "--turns", "2", "--rate", "2", "--system-tokens", "256",
                             "--user-tokens", "64", "--output-tokens", "16", "--duration", "90", "--seed", "2"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=e2e.child_env())
    try:
        time.sleep(4)
        victim = serving.ready_pods("decode")[0]["metadata"]["name"]
        assert serving.api.delete(f"/api/v1/namespaces/{NS}/pods/{victim}").status_code == 200
        stdout, stderr = load.communicate(timeout=180)
    finally:
        if load.poll() is None:
            load.kill()
    assert load.returncode == 0, stdout[-2000:] + stderr[-4000:]
    summary = json.loads(out.read_text())
    assert summary["requests"] == 24 and summary["failed_requests"] == 0, summary.get("errors")
    wait_for("two Ready decode pods again, the deleted one replaced", lambda: (
        names := {p["metadata"]["name"] for p in serving.ready_pods("decode")}) and len(names) == 2
        and victim not in names, on_fail=serving.diagnose)


def test_a_restarted_router_routes_with_the_same_hit_rate(serving: Serving) -> None:
    args = ("--sessions", "6", "--turns", "2", "--rate", "3", "--system-tokens", "512", "--user-tokens", "64",
            "--output-tokens", "8", "--duration", "60")
    before = serving.load(*args, "--seed", "3")
    (router,) = serving.ready_pods("router")
    status = router["status"]["containerStatuses"][0]
    pid = int(status["containerID"].removeprefix("process://"))
    os.kill(pid, signal.SIGKILL)  # a crash: the kubelet restarts the container, the router keeps no state
    wait_for("the router restarted and Ready", lambda: (r := serving.ready_pods("router")) and r[0]["status"][
        "containerStatuses"][0]["restartCount"] > status["restartCount"], on_fail=serving.diagnose)
    after = serving.load(*args, "--seed", "4")
    assert before["failed_requests"] == 0 and after["failed_requests"] == 0, (before["errors"], after["errors"])
    assert after["hit_rate"] >= before["hit_rate"] - 0.1, (before["hit_rate"], after["hit_rate"])


def test_router_auth_from_the_pddeployments_secret_admits_only_its_tokens(serving: Serving) -> None:
    """spec.router.auth.secretName: the operator mounts the Secret into a new router pod (rolled surge
    first), which then answers 401 without a known bearer token; the Secret's keys are the credentials."""
    token = "e2e-router-token-0123456789"
    secret = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "router-tokens"},
              "stringData": {"e2e-client": token}}
    assert serving.api.post(f"/api/v1/namespaces/{NS}/secrets", json=secret).status_code == 201
    path = f"/apis/daybreak.dev/v1alpha1/namespaces/{NS}/pddeployments/{PDD}"

    def patch_router(router: dict[str, Any]) -> None:
        r = serving.api.patch(path, content=json.dumps({"spec": {"router": router}}),
                              headers={"Content-Type": "application/merge-patch+json"})
        assert r.status_code == 200, r.text

    def one_router(with_auth: bool) -> str | None:
        ready = serving.ready_pods("router")
        if len(ready) == 1 and ("--auth-dir" in ready[0]["spec"]["containers"][0]["command"]) == with_auth:
            return f"http://{ready[0]['status']['podIP']}:8000"
        return None

    patch_router({"auth": {"secretName": "router-tokens"}})
    try:
        url = wait_for("the router rolled to one with auth", lambda: one_router(True), timeout=180,
                       on_fail=serving.diagnose)
        body = {"model": "sim/tiny", "prompt": "authenticated " * 8, "max_tokens": 2}
        assert httpx.post(f"{url}/v1/completions", json=body, timeout=60).status_code == 401
        wrong = httpx.post(f"{url}/v1/completions", json=body, timeout=60,
                           headers={"Authorization": "Bearer e2e-router-token-wrong-000"})
        assert wrong.status_code == 401 and wrong.headers["www-authenticate"].startswith("Bearer")
        right = httpx.post(f"{url}/v1/completions", json=body, timeout=60,
                           headers={"Authorization": f"Bearer {token}"})
        assert right.status_code == 200, right.text
        assert not [h for h in right.headers if h.startswith("x-daybreak")]  # no pod addresses
    finally:
        patch_router({"auth": None})
        wait_for("the router rolled back to one without auth", lambda: one_router(False), timeout=180,
                 on_fail=serving.diagnose)
