"""Rolling upgrades mid-load on the local cluster: a compatible one keeps the pool's hit rate, an
incompatible one moves to a new kvNamespace, never serves the old weights' KV and flushes the old
namespace's blocks; an agent DaemonSet roll loses no request.

The operator runs as a process; the process kubelet runs the pool's agents, the sim engines and the
router as real processes. `daybreak load` drives multi-turn sessions through the router's Service (the
local cluster has no kube-proxy: ``ServiceProxy`` follows the Service's EndpointSlices as a ClusterIP
does) while the PDDeployment or the agents roll. Sim KV bytes derive from the namespace and every block
read is checked by content, so a stale block shows as ``blocks_corrupt``. Bounds are generous.
"""

from __future__ import annotations

import base64
import json
import math
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from daybreak.client import KVPoolClient
from daybreak.devenv.cluster import LocalCluster
from daybreak.pool.engine_secret import credential_secret_name
from daybreak.serving.prompt import parse_prompt
from daybreak.testing.e2e import E2ENamespace, ServiceProxy, run_load, wait_for
from daybreak.testing.operator_process import OperatorProcess

pytestmark = pytest.mark.e2e

NS = "upgrade-e2e"
PDD = "up"
BLOCK_TOKENS = 16
RATE = 0.6
ENGINE_ARGS = ["--time-scale", "2", "--drain-seconds", "8"]
TURNS = 4
LOAD_ARGS = ["--turns", str(TURNS), "--system-tokens", "256", "--user-tokens", "128", "--output-tokens", "32"]
ROLES = ("prefill", "decode")
PROBE = {"model": "sim-model", "prompt": "The flush probe: a prompt of its own, long enough for blocks. " * 6,
         "max_tokens": 2}


@dataclass
class Env:
    ns: E2ENamespace
    operator: OperatorProcess
    router: ServiceProxy
    workdir: Path
    results: dict[str, dict[str, Any]] = field(default_factory=dict)
    marks: dict[str, float] = field(default_factory=dict)

    def get(self, path: str) -> dict[str, Any]:
        body = self.ns.get(path)
        if body is None:
            raise KeyError(path)
        return body

    def diagnose(self) -> str:
        return f"--- operator ---\n{self.operator.log()[-3000:]}\n{self.ns.pod_logs(tail=800)}"

    def wait(self, what: str, probe: Callable[[], Any], *, timeout: float = 180.0) -> Any:
        return wait_for(what, probe, timeout=timeout, interval=0.5, diagnose=self.diagnose)

    def pdd(self) -> dict[str, Any]:
        return self.get(f"/apis/daybreak.dev/v1alpha1/namespaces/{NS}/pddeployments/{PDD}")

    def patch_spec(self, spec: dict[str, Any]) -> None:
        resp = self.ns.client.patch(f"/apis/daybreak.dev/v1alpha1/namespaces/{NS}/pddeployments/{PDD}",
                                    content=json.dumps({"spec": spec}),
                                    headers={"Content-Type": "application/merge-patch+json"})
        resp.raise_for_status()

    def engine_pods(self, *, terminating: bool = False) -> list[dict[str, Any]]:
        return [p for p in self.ns.pods(f"daybreak.dev/deployment={PDD}")
                if p["metadata"]["labels"].get("daybreak.dev/role") in ROLES and (
                    terminating or not p["metadata"].get("deletionTimestamp"))]

    def rolled_to(self, kv_namespace: str) -> bool:
        """Both roles run only ready pods of the current template (labelled with ``kv_namespace``)."""
        for role in ROLES:
            d = self.get(f"/apis/apps/v1/namespaces/{NS}/deployments/{PDD}-{role}")
            st = d.get("status") or {}
            want = int(d["spec"]["replicas"])
            if not (st.get("observedGeneration") == d["metadata"]["generation"] and st.get("updatedReplicas") == want
                    and st.get("readyReplicas") == want and st.get("replicas") == want):
                return False
        labels = {p["metadata"]["labels"].get("daybreak.dev/kv-namespace") for p in self.engine_pods()}
        return labels == {kv_namespace}

    def load(self, name: str, *, seconds: float, seed: int) -> dict[str, Any]:
        # Enough sessions that arrivals last the whole duration (a session ends after its turns), so a
        # load covers the roll it runs over.
        sessions = math.ceil(RATE * seconds / TURNS) + 4
        args = ["--sessions", str(sessions), "--rate", str(RATE), "--duration", str(seconds), "--seed", str(seed),
                "--request-timeout", "120", *LOAD_ARGS]
        started = time.monotonic()
        self.results[name] = result = run_load(self.router.url, self.workdir / f"{name}.json", args,
                                               timeout=seconds + 180)
        result["wall_s"] = round(time.monotonic() - started, 1)
        return result

    def load_while(self, change: Callable[[], None], *, name: str, seconds: float, seed: int,
                   after: float = 8.0) -> dict[str, Any]:
        """Run a load and apply ``change`` ``after`` seconds into it; returns the load's summary."""
        result: dict[str, Any] = {}
        failure: list[BaseException] = []

        def run() -> None:
            try:
                result.update(self.load(name, seconds=seconds, seed=seed))
            except BaseException as exc:  # re-raised in the test's thread below
                failure.append(exc)

        t = threading.Thread(target=run)
        t.start()
        time.sleep(after)
        self.marks[f"{name}_change"] = time.monotonic()
        change()
        t.join(timeout=seconds + 240)
        if failure:
            raise failure[0]
        assert result, f"load {name} did not finish"
        return result


@pytest.fixture(scope="module")
def env(cluster: LocalCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    assert cluster.kubelet is not None, "the upgrade scenario needs the process kubelet"
    workdir = tmp_path_factory.mktemp("upgrade-e2e")
    ns = E2ENamespace(cluster, NS).open()
    op = OperatorProcess(kubeconfig=cluster.kubeconfig, log_path=workdir / "operator.log", namespace=NS,
                         identity="upgrade-e2e", lease_namespace=NS, resync_seconds=5).start()
    router = ServiceProxy(ns.client, NS, PDD)
    e = Env(ns, op, router, workdir)
    try:
        ns.apply({"apiVersion": "daybreak.dev/v1alpha1", "kind": "KVPool", "metadata": {"name": "pool"},
                  "spec": {"nodeSelector": {"daybreak.dev/accelerator": "sunrise"},
                           "tiers": {"dram": {"bytesPerNode": "256Mi"}}, "transport": {"preference": ["tcp"]}}},
                 {"apiVersion": "daybreak.dev/v1alpha1", "kind": "PDDeployment", "metadata": {"name": PDD},
                  "spec": {
                      "poolRef": {"name": "pool"},
                      # 1 KiB blocks: the KV bytes moved stay cheap on 2 cores.
                      "model": {"name": "sim-model", "revision": "r1",
                                "kvLayout": {"numLayers": 2, "numKVHeads": 1, "headDim": 8, "dtype": "float16",
                                             "blockTokens": BLOCK_TOKENS}},
                      "engine": {"kind": "sim", "args": ENGINE_ARGS},
                      "prefill": {"replicas": 1},
                      "decode": {"replicas": 1},
                      "updateStrategy": {"cache": "flush"},
                      "router": {"cacheStatistics": True},  # the hit rates read cached_tokens
                  }})
        e.wait("the router and one engine per role ready", lambda: e.ns.ready_pods(
            f"daybreak.dev/deployment={PDD},daybreak.dev/role=router") and e.rolled_to(str(e.pdd()["status"][
                "kvNamespace"])))
        router.start()
        e.wait("the router Service's endpoint", router.endpoints)
        yield e
    finally:
        router.stop()
        op.stop()
        summary = {"results": {k: {m: v.get(m) for m in ("requests", "failed_requests", "errors", "hit_rate",
                                                         "pool_hit_rate", "bytes_read", "blocks_corrupt",
                                                         "ttft_p90_s", "wall_s")} for k, v in e.results.items()},
                   "marks": e.marks, "router_connections": router.connections}
        (workdir / "summary.json").write_text(json.dumps(summary, indent=1))
        print(json.dumps(summary, indent=1))
        ns.close()


def test_a_compatible_upgrade_mid_load_keeps_the_hit_rate(env: Env) -> None:
    before = env.load("before", seconds=30, seed=1)
    assert before["failed_requests"] == 0, before
    assert before["hit_rate"] and before["hit_rate"] > 0.3, before  # multi-turn sessions do hit
    ns = str(env.pdd()["status"]["kvNamespace"])
    old_pods = {p["metadata"]["name"] for p in env.engine_pods()}
    # New engine args: a new pod template, the same kvNamespace (and the router is left alone).
    router_pods = {p["metadata"]["name"] for p in env.ns.pods(f"daybreak.dev/deployment={PDD},daybreak.dev/role=router")}
    during = env.load_while(lambda: env.patch_spec({"engine": {"kind": "sim", "args": [*ENGINE_ARGS, "--pool-workers",
                                                                                        "3"]}}),
                            name="compatible", seconds=40, seed=2)
    env.wait("the compatible roll to finish", lambda: env.rolled_to(ns) and not (
        old_pods & {p["metadata"]["name"] for p in env.engine_pods()}))
    env.marks["compatible_rolled"] = time.monotonic()
    assert env.pdd()["status"]["kvNamespace"] == ns
    assert {p["metadata"]["name"] for p in env.ns.pods(f"daybreak.dev/deployment={PDD},daybreak.dev/role=router")
            } == router_pods
    after = env.load("after_compatible", seconds=30, seed=3)
    for r in (during, after):
        assert r["failed_requests"] == 0, r
        assert r["blocks_corrupt"] == 0, r
    # Within 10% of before: the new engines find the old ones' blocks in the pool.
    assert after["hit_rate"] >= 0.9 * before["hit_rate"], (before["hit_rate"], after["hit_rate"])
    assert during["hit_rate"] >= 0.9 * before["hit_rate"], (before["hit_rate"], during["hit_rate"])


def _credential(env: Env, kv_namespace: str) -> str:
    secret = env.get(f"/api/v1/namespaces/{NS}/secrets/{credential_secret_name(PDD, kv_namespace)}")
    return base64.b64decode(secret["data"]["token"]).decode()


def _agents(env: Env) -> list[str]:
    pool = env.get(f"/apis/daybreak.dev/v1alpha1/namespaces/{NS}/kvpools/pool")
    return [f"{e['address']}:{e['port']}" for e in (pool.get("status") or {}).get("endpoints") or []]


def _held(env: Env, kv_namespace: str, keys: list[str]) -> list[bool]:
    """Which of ``keys`` some agent of the pool holds in ``kv_namespace`` (asked with that namespace's credential)."""
    client = KVPoolClient(_agents(env), token=_credential(env, kv_namespace), namespace=kv_namespace,
                          transport="tcp", timeout_seconds=10.0)
    try:
        return client.batch_exists(keys)
    finally:
        client.close()


class Generations:
    """Samples every engine pod's served-request counter, keyed by the pod's kvNamespace label.

    Terminating pods too: a replaced pod drains (``--drain-seconds``) and the requests it finishes then
    count as served by its generation.
    """

    def __init__(self, env: Env) -> None:
        self.env = env
        self.samples: list[tuple[float, str, str, float]] = []  # (t, pod, kvNamespace, requests served)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stop.wait(1.0):
            try:
                pods = [p for p in self.env.engine_pods(terminating=True) if (p.get("status") or {}).get("podIP")]
            except httpx.HTTPError:
                continue
            for pod in pods:
                try:
                    text = httpx.get(f"http://{pod['status']['podIP']}:8000/metrics", timeout=5).text
                except httpx.HTTPError:
                    continue  # not serving yet, or gone
                served = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                             if line.startswith("vllm:request_success_total"))
                self.samples.append((time.monotonic(), pod["metadata"]["name"],
                                     pod["metadata"]["labels"].get("daybreak.dev/kv-namespace", ""), served))

    def served_after(self, kv_namespace: str, t: float) -> float:
        """Requests the pods of ``kv_namespace`` served after ``t`` (counter growth per pod, summed)."""
        base: dict[str, float] = {}  # per pod: its count at t (0 for a pod that started after t)
        last: dict[str, float] = {}
        for when, pod, ns, served in self.samples:
            if ns == kv_namespace:
                if when <= t:
                    base[pod] = served
                last[pod] = served
        return sum(last[p] - base.get(p, 0.0) for p in last)


def test_an_incompatible_upgrade_changes_the_namespace_serves_no_stale_kv_and_flushes_the_old_blocks(env: Env) -> None:
    old_ns = str(env.pdd()["status"]["kvNamespace"])
    # A request of our own through the router: its full blocks are in the pool under the old namespace.
    resp = httpx.post(f"{env.router.url}/v1/completions", json=PROBE, timeout=60)
    assert resp.status_code == 200, resp.text
    keys = parse_prompt(PROBE).keys(BLOCK_TOKENS)
    assert len(keys) >= 4 and all(_held(env, old_ns, keys)), "the probe's blocks should be in the pool"
    old_router = {p["metadata"]["name"] for p in env.ns.ready_pods(f"daybreak.dev/deployment={PDD},daybreak.dev/role=router")}
    generations = Generations(env)
    generations.thread.start()

    def change() -> None:
        env.patch_spec({"model": {"revision": "r2"}})
        # A request sent as the change lands: the new generation's pods cannot be Ready yet (they have
        # not started), so the old one must serve it. The load alone may send none in the old pods'
        # last seconds (0.6 req/s, and a new engine is Ready a few seconds after the change).
        resp = httpx.post(f"{env.router.url}/v1/completions", json={**PROBE, "prompt": "As the change lands. " * 8},
                          timeout=60)
        assert resp.status_code == 200, resp.text

    try:
        during = env.load_while(change, name="incompatible", seconds=45, seed=4)
        new_ns = env.wait("a new kvNamespace", lambda: (ns := env.pdd()["status"].get("kvNamespace")) != old_ns and ns)
        env.wait("the incompatible roll to finish", lambda: env.rolled_to(str(new_ns)))
        env.marks["incompatible_rolled"] = time.monotonic()
    finally:
        generations.stop.set()
        generations.thread.join(timeout=10)
    change = env.marks["incompatible_change"]
    # Both generations served during the roll: the old pods kept serving after the change, the new ones
    # served while an old one was still there.
    assert generations.served_after(old_ns, change) > 0, generations.samples[-10:]
    assert generations.served_after(str(new_ns), change) > 0, generations.samples[-10:]
    # The router rolled (its credential is the namespace's) and drained: no request failed on it.
    new_router = {p["metadata"]["name"] for p in env.ns.ready_pods(f"daybreak.dev/deployment={PDD},daybreak.dev/role=router")}
    assert new_router and not new_router & old_router, (old_router, new_router)
    assert during["failed_requests"] == 0, during
    assert during["completed_requests"] > 0, during

    # updateStrategy.cache flush: every agent flushed the old namespace, the bytes are in status and an Event.
    retired = env.wait("the old namespace flushed", lambda: (r := env.pdd()["status"].get("retiredKVNamespace"))
                       and r.get("bytesFreed") is not None and r)
    assert retired["kvNamespace"] == old_ns and retired["policy"] == "flush", retired
    assert retired["bytesFreed"] >= len(keys) * 1024, retired  # 1 KiB blocks; the probe's alone are this much
    events = [e for e in env.ns.events(PDD) if e["reason"] == "KVNamespaceFlushed"]
    assert events and f"{retired['bytesFreed']} bytes freed" in events[-1]["message"], events
    reports = [r for node in env.get("/apis/daybreak.dev/v1alpha1/kvnodes")["items"]
               for r in (node.get("status") or {}).get("namespaceFlushes") or [] if r.get("kvNamespace") == old_ns]
    assert len(reports) == len(_agents(env)) and sum(int(r["bytesFreed"]) for r in reports) == retired["bytesFreed"]
    env.marks["flushed_bytes"] = retired["bytesFreed"]
    env.marks["flushed_blocks"] = sum(int(r.get("blocks") or 0) for r in reports)
    # The old namespace's blocks are gone from every agent (the client asks every live agent).
    assert not any(_held(env, old_ns, keys)), "flushed blocks are still in the pool"

    after = env.load("after_incompatible", seconds=30, seed=5)
    for r in (during, after):
        # Each block read is checked against the bytes its namespace implies: none came from r1.
        assert r["blocks_corrupt"] == 0, r
    assert after["failed_requests"] == 0, after
    assert after["bytes_read"] > 0, after  # blocks were read, so the content check ran
    # The new generation builds its own cache again.
    assert after["hit_rate"] and after["hit_rate"] > 0.3, after


def test_an_agent_daemonset_roll_mid_load_loses_no_request_and_the_hit_rate_recovers(env: Env) -> None:
    path = f"/apis/apps/v1/namespaces/{NS}/daemonsets/pool-agent"
    before = env.load("before_agents", seconds=30, seed=6)
    generation = int(env.get(path)["metadata"]["generation"])

    def rolled() -> bool:
        ds = env.get(path)
        st = ds.get("status") or {}
        want = st.get("desiredNumberScheduled")
        return bool(int(ds["metadata"]["generation"]) > generation and st.get("observedGeneration") ==
                    ds["metadata"]["generation"] and want and st.get("updatedNumberScheduled") == want
                    and st.get("numberReady") == want)

    # What `kubectl rollout restart` does: a new pod template, rolled one node at a time (maxUnavailable 1).
    during = env.load_while(lambda: env.ns.cluster.kubectl("rollout", "restart", "-n", NS, "daemonset/pool-agent"),
                            name="agents_roll", seconds=60, seed=7, after=5.0)
    env.wait("the agent DaemonSet rolled", rolled)
    done = time.monotonic()
    env.marks["agents_rolled_after_change_s"] = round(done - env.marks["agents_roll_change"], 1)
    after = env.load("after_agents", seconds=30, seed=8)
    for r in (during, after):
        assert r["failed_requests"] == 0, r
        assert r["blocks_corrupt"] == 0, r
    # The load right after the roll ends within a minute of it and is back within 10% of before.
    env.marks["after_agents_ended_after_roll_s"] = round(time.monotonic() - done, 1)
    assert after["hit_rate"] >= 0.9 * before["hit_rate"], (before["hit_rate"], after["hit_rate"])
