"""A vLLM PDDeployment on the local cluster: the process kubelet runs real vLLM pods that share KV through the pool.

The operator (a real process) turns a KVPool and a PDDeployment with
``engine.kind: vllm`` into agents, one prefill and one decode vLLM server and
a router; the process kubelet runs them all (vLLM with the interpreter of
``make vllm-env``, the model the tiny one built locally). A request through
the router goes to prefill for one token, then to decode, which loads the
prompt's blocks from the pool. The reference is the same request sent to the
prefill engine alone: a producer never loads, so it computes every token.

The local cluster has no DNS: the connector finds the pool's agents as the
operator's pod gives it, through the KVPool's published ``status.endpoints``
read with the pod's ServiceAccount (``DAYBREAK_POOL_REF``); nothing in the
deployment names an agent's address.
"""

from __future__ import annotations

import json
import os
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest
import yaml

from daybreak.client.discovery import endpoints_from_pool
from daybreak.devenv.cluster import LocalCluster
from daybreak.testing import e2e
from daybreak.testing.operator_process import OperatorProcess

pytestmark = [pytest.mark.e2e, pytest.mark.vllm, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[2]
NS = "vllm-e2e"
POOL = "kv-vllm"
PDD = "tiny-vllm"
# The tiny model (daybreak.testing.tinymodel.SMALL) on vLLM's CPU backend.
LAYOUT = {"numLayers": 4, "numKVHeads": 4, "headDim": 64, "dtype": "bfloat16", "blockTokens": 128,
          "platform": "cpu"}
PROMPT_TOKENS = 700
LOADABLE = (PROMPT_TOKENS - 1) // 128 * 128  # full blocks; the last prompt token is always computed
MAX_TOKENS = 12
HITS = "vllm:external_prefix_cache_hits_total"
# As in testing/vllm_server.py: eager, a small KV cache (256 MiB), one core per engine.
VLLM_ARGS = ["--dtype", "bfloat16", "--max-model-len", "2048", "--enforce-eager", "--enable-prompt-tokens-details",
             "--max-num-seqs", "8", "--kv-cache-memory-bytes", str(256 << 20)]
T = TypeVar("T")


def wait_for(what: str, probe: Callable[[], T | None], *, timeout: float, on_fail: Callable[[], str]) -> T:
    return e2e.wait_for(what, probe, timeout=timeout, interval=0.5, diagnose=on_fail)


def metric(url: str, name: str) -> float:
    total = 0.0
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


def group_memory_kib(pgid: int) -> tuple[int, int, int]:
    """(processes, RSS KiB, PSS KiB) summed over a process group: vLLM's API server, engine core and worker."""
    count = rss = pss = 0
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            fields = (proc / "stat").read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) != pgid:  # field 5 of stat: the process group
                continue
            rollup = dict(line.split(":", 1) for line in (proc / "smaps_rollup").read_text().splitlines()[1:])
        except (OSError, ValueError, IndexError):
            continue
        count += 1
        rss += int(rollup["Rss"].split()[0])
        pss += int(rollup["Pss"].split()[0])
    return count, rss, pss


@dataclass
class VllmDeployment:
    cluster: LocalCluster
    api: httpx.Client
    operator: OperatorProcess
    model: Path
    figures: dict[str, Any]
    pool_endpoints: list[str]

    def ready_pods(self, role: str) -> list[dict[str, Any]]:
        body = self.api.get(f"/api/v1/namespaces/{NS}/pods",
                            params={"labelSelector": f"daybreak.dev/deployment={PDD},daybreak.dev/role={role}"}).json()
        return [p for p in body.get("items") or [] if not p["metadata"].get("deletionTimestamp") and any(
            c["type"] == "Ready" and c["status"] == "True" for c in p["status"].get("conditions") or [])]

    def url(self, role: str) -> str:
        (pod,) = wait_for(f"one Ready {role} pod", lambda: (p := self.ready_pods(role)) and len(p) == 1 and p,
                          timeout=60, on_fail=self.diagnose)
        return f"http://{pod['status']['podIP']}:8000"

    def diagnose(self) -> str:
        lines = [f"--- operator ---\n{self.operator.log()[-2000:]}"]
        for log in sorted((self.cluster.directory / "pods").glob(f"{NS}_*/*.log")):
            lines.append(f"--- {log.parent.name}/{log.name} ---\n{log.read_text(errors='replace')[-2500:]}")
        return "\n".join(lines)


def _time(iso: str) -> datetime:
    return datetime.strptime(iso, "%Y-%m-%dT%H:%M:%SZ")


def _ready(obj: dict[str, Any]) -> bool:
    return any(c["type"] == "Ready" and c["status"] == "True" for c in (obj.get("status") or {}).get("conditions") or [])


def _engine_env(role_cpu: int) -> dict[str, Any]:
    # One OpenMP thread on its own core per engine (REFERENCE.md "vLLM on CPU"): prefill 0, decode 1.
    return {"spec": {"containers": [{"name": "engine", "env": [
        {"name": "VLLM_CPU_OMP_THREADS_BIND", "value": str(role_cpu)}]}]}}


@pytest.fixture(scope="module")
def deployment(cluster: LocalCluster, tiny_model: Path, vllm_python: Path,
               tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmDeployment]:
    assert cluster.kubelet is not None, "vLLM pods need the process kubelet"
    logs = tmp_path_factory.mktemp("vllm-local-cluster")
    space = e2e.E2ENamespace(cluster, NS).open()
    api = space.client
    operator = OperatorProcess(kubeconfig=cluster.kubeconfig, log_path=logs / "operator.log", namespace=NS,
                               identity="vllm-e2e", lease_namespace=NS, resync_seconds=5.0)
    env = VllmDeployment(cluster, api, operator, tiny_model, {}, [])
    pool_path = f"/apis/daybreak.dev/v1alpha1/namespaces/{NS}/kvpools/{POOL}"
    try:
        operator.start()
        pool = {"apiVersion": "daybreak.dev/v1alpha1", "kind": "KVPool", "metadata": {"name": POOL},
                "spec": {"nodeSelector": {"daybreak.dev/accelerator": "sunrise"},
                         "tiers": {"dram": {"bytesPerNode": "256Mi"}},
                         "transport": {"preference": ["shm", "tcp"]}}}
        cluster.kubectl("apply", "-n", NS, "-f", "-", stdin=yaml.safe_dump(pool))
        endpoints = wait_for("the KVPool's agents published", lambda: (
            e := endpoints_from_pool(api.get(pool_path).json())) and len(e) == 2 and e, timeout=180,
            on_fail=env.diagnose)
        env.pool_endpoints[:] = endpoints
        pdd = {"apiVersion": "daybreak.dev/v1alpha1", "kind": "PDDeployment", "metadata": {"name": PDD},
               "spec": {"poolRef": {"name": POOL},
                        "model": {"name": str(tiny_model), "revision": "local", "kvLayout": LAYOUT},
                        "engine": {"kind": "vllm", "image": "vllm/vllm-openai:local", "args": VLLM_ARGS,
                                   "env": [{"name": "HF_HUB_OFFLINE", "value": "1"},
                                           {"name": "VLLM_NO_USAGE_STATS", "value": "1"},
                                           {"name": "DO_NOT_TRACK", "value": "1"}]},
                        "prefill": {"replicas": 1, "template": _engine_env(0)},
                        "decode": {"replicas": 1, "template": _engine_env(1)},
                        "router": {"cacheStatistics": True}}}  # the test reads cached_tokens through it
        started = time.monotonic()
        env.figures["load_average_before"] = [round(x, 2) for x in os.getloadavg()]
        cluster.kubectl("apply", "-n", NS, "-f", "-", stdin=yaml.safe_dump(pdd))
        wait_for("the vLLM PDDeployment Ready", lambda: _ready(api.get(
            f"/apis/daybreak.dev/v1alpha1/namespaces/{NS}/pddeployments/{PDD}").json()), timeout=480,
            on_fail=env.diagnose)
        env.figures["apply_to_ready_seconds"] = round(time.monotonic() - started, 1)
        env.figures["load_average_ready"] = [round(x, 2) for x in os.getloadavg()]
        yield env
    finally:
        operator.stop()
        # A KVNode is per node, not per pool: ours must go before later tests run pools on the same nodes.
        space.close(wait_seconds=180)
        (logs / "figures.json").write_text(json.dumps(env.figures, indent=2))
        print(f"vllm-local-cluster figures: {json.dumps(env.figures)}")


def test_the_engine_pods_are_real_vllm_processes_run_by_the_process_kubelet(deployment: VllmDeployment) -> None:
    for role, kv_role in (("prefill", "kv_producer"), ("decode", "kv_consumer")):
        (pod,) = deployment.ready_pods(role)
        status = pod["status"]["containerStatuses"][0]
        pid = int(status["containerID"].removeprefix("process://"))  # kwok's fake pods carry no such id
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        assert argv[1:3] == [b"-m", b"vllm.entrypoints.openai.api_server"], argv
        assert Path(argv[0].decode()).parent.parent.name == ".venv-vllm"
        config = json.loads(argv[argv.index(b"--kv-transfer-config") + 1])
        assert config["kv_role"] == kv_role
        url = f"http://{pod['status']['podIP']}:8000"
        models = httpx.get(url + "/v1/models", timeout=10).json()
        assert [m["id"] for m in models["data"]] == [str(deployment.model)]
        processes, rss, pss = group_memory_kib(pid)
        ready_at = next(c["lastTransitionTime"] for c in pod["status"]["conditions"] if c["type"] == "Ready")
        deployment.figures[role] = {
            "processes": processes, "rss_mib": round(rss / 1024), "pss_mib": round(pss / 1024),
            # From the kubelet starting the process to the pod's Ready (vLLM's /health answering).
            "start_to_ready_seconds": (_time(ready_at) - _time(status["state"]["running"]["startedAt"])).seconds}
        log = (deployment.cluster.directory / "pods" / f"{NS}_{pod['metadata']['name']}" / "engine.log").read_text()
        assert f"kv_role={kv_role}" in log and "event=kv_caches_registered layers=4" in log
        # Both connector sides (scheduler, worker) found the agents through the KVPool, not DNS.
        ready = [line for line in log.splitlines() if "event=connector_ready" in line]
        assert {side for side in ("role=SCHEDULER", "role=WORKER") if any(side in line for line in ready)} == {
            "role=SCHEDULER", "role=WORKER"}, ready
        for line in ready:
            assert f"endpoints={','.join(deployment.pool_endpoints)} pool_ref={NS}/{POOL}" in line, line
        found = [line for line in log.splitlines() if f"event=pool_discovered pool={NS}/{POOL}" in line]
        assert found, log[-3000:]
        deployment.figures[role]["pool_discovery_seconds"] = [float(x.rsplit("seconds=", 1)[1]) for x in found]
        # What the pod was given besides: the agents' Service name, which resolves nowhere here.
        pod_env = {e["name"]: e.get("value", "") for e in pod["spec"]["containers"][0]["env"]}
        assert f"{POOL}-agents.{NS}.svc:" in pod_env["DAYBREAK_POOL_ENDPOINTS"]


def test_a_request_through_the_router_is_prefilled_then_decoded_from_the_pools_kv(
        deployment: VllmDeployment) -> None:
    rng = random.Random(14)
    prompt = [rng.randrange(10, 4000) for _ in range(PROMPT_TOKENS)]
    request = {"model": str(deployment.model), "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
               "ignore_eos": True, "return_token_ids": True}
    prefill, decode, router = deployment.url("prefill"), deployment.url("decode"), deployment.url("router")
    before_prefill, before_decode = metric(prefill, "vllm:request_success_total"), metric(decode, HITS)
    started = time.monotonic()
    resp = httpx.post(router + "/v1/completions", json=request, timeout=300)
    deployment.figures["routed_request_seconds"] = round(time.monotonic() - started, 2)
    assert resp.status_code == 200, resp.text + deployment.diagnose()
    out = resp.json()
    assert metric(prefill, "vllm:request_success_total") - before_prefill == 1  # the router's prefill step
    assert metric(decode, HITS) - before_decode == LOADABLE  # decode loaded the prompt's full blocks
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == LOADABLE
    # The reference: prefill alone computes the whole completion (a producer never loads from the pool).
    reference = httpx.post(prefill + "/v1/completions", json=request, timeout=300).json()
    assert metric(prefill, HITS) == 0  # its cached tokens, if any, are its own prefix cache's
    assert out["choices"][0]["token_ids"] == reference["choices"][0]["token_ids"]
    assert len(out["choices"][0]["token_ids"]) == MAX_TOKENS
