"""The planner inside a real operator process against a real apiserver: scrape over HTTP, decide, write, annotate.

etcd + kube-apiserver only (no controllers): the test creates the role pods
itself and gives them loopback addresses where small HTTP servers publish
vLLM-named metrics the test steers (overloaded decode, then nearly idle). The
sim engine itself is exercised by test_elastic_e2e.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest
import yaml

from daybreak.devenv.cluster import LocalCluster
from daybreak.testing import e2e
from daybreak.testing.operator_process import OperatorProcess

ROOT = Path(__file__).resolve().parents[2]
NS = "planner-it"
T = TypeVar("T")
BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, float("inf"))


class EngineMetrics:
    """Cumulative vLLM-named counters that grow with wall time at the currently set load."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.running = 0.0
        self.waiting = 0.0
        self.itl = 0.01
        self.tokens = 0.0
        self.itl_sum = 0.0
        self.buckets = dict.fromkeys(BUCKETS, 0.0)
        self.last = time.monotonic()

    def set(self, *, running: float, waiting: float, itl: float) -> None:
        with self.lock:
            self._advance()
            self.running, self.waiting, self.itl = running, waiting, itl

    def _advance(self) -> None:
        now = time.monotonic()
        tokens = self.running / self.itl * (now - self.last)
        self.last = now
        self.tokens += tokens
        self.itl_sum += tokens * self.itl
        for le in BUCKETS:
            if self.itl <= le:
                self.buckets[le] += tokens

    def text(self) -> str:
        with self.lock:
            self._advance()
            lines = ["# TYPE vllm:num_requests_running gauge",
                     f'vllm:num_requests_running{{model_name="m"}} {self.running}',
                     "# TYPE vllm:num_requests_waiting gauge",
                     f'vllm:num_requests_waiting{{model_name="m"}} {self.waiting}',
                     "# TYPE vllm:kv_cache_usage_perc gauge",
                     f'vllm:kv_cache_usage_perc{{model_name="m"}} {min(1.0, self.running / 50)}',
                     "# TYPE vllm:inter_token_latency_seconds histogram"]
            for le in BUCKETS:
                bound = "+Inf" if le == float("inf") else repr(le)
                lines.append(f'vllm:inter_token_latency_seconds_bucket{{le="{bound}",model_name="m"}} '
                             f"{self.buckets[le]}")
            lines.append(f'vllm:inter_token_latency_seconds_sum{{model_name="m"}} {self.itl_sum}')
            lines.append(f'vllm:inter_token_latency_seconds_count{{model_name="m"}} {self.tokens}')
            return "\n".join(lines) + "\n"


def serve(address: str, metrics: EngineMetrics) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = metrics.text().encode()
            self.send_response(200 if self.path == "/metrics" else 404)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_: Any) -> None:
            pass

    server = ThreadingHTTPServer((address, 8000), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def wait_for(what: str, probe: Callable[[], T | None], *, op: OperatorProcess, timeout: float = 60.0) -> T:
    """``testing.e2e.wait_for`` with the operator's log in the failure message."""
    return e2e.wait_for(what, probe, timeout=timeout, diagnose=lambda: op.log()[-4000:])


@pytest.fixture
def world(kube: LocalCluster, tmp_path: Path) -> Iterator[tuple[LocalCluster, httpx.Client, OperatorProcess]]:
    kube.kubectl("apply", "-f", str(ROOT / "crds"))
    kube.kubectl("create", "namespace", NS)
    api = kube.api()
    op = OperatorProcess(kubeconfig=kube.kubeconfig, log_path=tmp_path / "operator.log", namespace=NS,
                         lease_namespace=NS, resync_seconds=60).start()
    try:
        yield kube, api, op
    finally:
        op.stop()
        kube.kubectl("delete", "namespace", NS, "--wait=false", check=False)
        api.close()


def _pod(name: str, role: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "labels": {"daybreak.dev/deployment": "auto", "daybreak.dev/role": role}},
            "spec": {"automountServiceAccountToken": False,
                     "containers": [{"name": "engine", "image": "daybreak:dev"}]}}


def test_planner_scales_decode_up_then_in_with_status_events_metrics_and_deletion_costs(world: Any) -> None:
    kube, api, op = world
    api.post(f"/api/v1/namespaces/{NS}/serviceaccounts", json={"metadata": {"name": "default"}})
    kube.kubectl("apply", "-n", NS, "-f", "-", stdin=yaml.safe_dump({
        "apiVersion": "daybreak.dev/v1alpha1", "kind": "KVPool", "metadata": {"name": "pool"},
        "spec": {"tiers": {"dram": {"bytesPerNode": "1Gi"}}}}))
    pdd = yaml.safe_load((ROOT / "examples" / "pddeployment-sim.yaml").read_text())
    pdd["metadata"] = {"name": "auto"}
    pdd["spec"]["poolRef"] = {"name": "pool"}
    pdd["spec"]["prefill"] = {"replicas": 1, "minReplicas": 1, "maxReplicas": 3}
    pdd["spec"]["decode"] = {"replicas": 2, "minReplicas": 1, "maxReplicas": 6}
    pdd["spec"]["autoscaling"] = {"enabled": True, "itlSeconds": 0.05, "intervalSeconds": 1,
                                  "scaleUpStabilizationSeconds": 1, "scaleDownStabilizationSeconds": 4}
    kube.kubectl("apply", "-n", NS, "-f", "-", stdin=yaml.safe_dump(pdd))

    engines = {"auto-decode-a": EngineMetrics(), "auto-decode-b": EngineMetrics(), "auto-prefill-a": EngineMetrics()}
    servers = []
    try:
        for i, (name, m) in enumerate(engines.items()):
            address = f"127.77.0.{i + 1}"
            servers.append(serve(address, m))
            role = "prefill" if "prefill" in name else "decode"
            resp = api.post(f"/api/v1/namespaces/{NS}/pods", json=_pod(name, role))
            assert resp.status_code == 201, resp.text
            resp = api.patch(f"/api/v1/namespaces/{NS}/pods/{name}/status",
                             json={"status": {"phase": "Running", "podIP": address}},
                             headers={"Content-Type": "application/merge-patch+json"})
            assert resp.status_code == 200, resp.text
        # Overloaded decode at two batch sizes (so the ITL line can be fitted: 0.01 + 0.002 x batch).
        engines["auto-decode-a"].set(running=30, waiting=5, itl=0.07)
        engines["auto-decode-b"].set(running=20, waiting=5, itl=0.05)

        def path(kind: str, name: str) -> str:
            if kind == "pdd":
                return f"/apis/daybreak.dev/v1alpha1/namespaces/{NS}/pddeployments/{name}"
            return f"/apis/apps/v1/namespaces/{NS}/deployments/{name}"

        def decode_replicas() -> int:
            return int(api.get(path("deploy", "auto-decode")).json()["spec"]["replicas"])

        wait_for("decode scaled up", lambda: decode_replicas() > 2, op=op)
        def recorded() -> dict[str, Any] | None:
            b = api.get(path("pdd", "auto")).json()
            status = b.get("status") or {}
            done = (status.get("lastScale") or {}).get("role") == "decode" and \
                status["decode"]["desiredReplicas"] == decode_replicas()
            return dict(b) if done else None

        # The status write follows the Deployment's: wait for the decision to be recorded too.
        body = wait_for("the scale-up in status.lastScale", recorded, op=op)
        last = body["status"]["lastScale"]
        assert last["role"] == "decode" and last["to"] > last["from"] == 2, last
        assert "tokens_per_s" in last["numbers"] and last["reason"]
        assert body["spec"]["decode"]["replicas"] == 2  # the user's spec is untouched
        assert body["status"]["decode"]["desiredReplicas"] == decode_replicas()
        assert int(api.get(path("deploy", "auto-prefill")).json()["spec"]["replicas"]) == 1
        wait_for("an Autoscaled event", lambda: api.get(
            f"/api/v1/namespaces/{NS}/events",
            params={"fieldSelector": "involvedObject.name=auto,reason=Autoscaled"}).json()["items"], op=op)
        assert op.metric("daybreak_planner_scale_decisions_total", role="decode", direction="up") >= 1
        assert op.metric("daybreak_planner_input", role="decode", input="tokens_per_s") > 0
        peak = decode_replicas()

        # Nearly idle, pod b the idler: after the 4 s window the role scales in, b marked the cheapest victim.
        engines["auto-decode-a"].set(running=2, waiting=0, itl=0.014)
        engines["auto-decode-b"].set(running=1, waiting=0, itl=0.012)
        started = time.monotonic()
        wait_for("decode scaled in", lambda: decode_replicas() < peak, op=op)
        assert time.monotonic() - started >= 3.0  # not before the stabilisation window (4 s, minus one interval)

        def cost(name: str) -> int:
            ann = api.get(f"/api/v1/namespaces/{NS}/pods/{name}").json()["metadata"].get("annotations") or {}
            return int(ann["controller.kubernetes.io/pod-deletion-cost"])

        assert cost("auto-decode-b") < cost("auto-decode-a")
        # The status write follows the Deployment's (as for the scale-up): wait for the scale-in's record.
        wait_for("the scale-in in status.lastScale",
                 lambda: api.get(path("pdd", "auto")).json()["status"]["lastScale"]["to"] < peak, op=op)
    finally:
        for s in servers:
            s.shutdown()
            s.server_close()
