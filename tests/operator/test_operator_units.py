"""Unit tests of the operator's pure parts: child manifests, status and conditions, names, queue, settings."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from daybreak.agent.settings import AgentSettings
from daybreak.api.kvcompat import KVLayout, kv_namespace
from daybreak.api.kvpool import KVPool
from daybreak.api.pddeployment import PDDeployment, Role
from daybreak.operator import conditions as cond
from daybreak.operator import deployment as pdd_mod
from daybreak.operator import pool as pool_mod
from daybreak.operator.children import dns_name, owner_reference, standard_labels
from daybreak.operator.leader import LeaseTiming
from daybreak.operator.settings import OperatorSettings
from daybreak.operator.workqueue import WorkQueue
from daybreak.pool.engine_secret import credential_secret_name

ROOT = Path(__file__).resolve().parents[2]
IMAGE = "example.test/daybreak:1"


def _load(name: str, **meta: Any) -> dict[str, Any]:
    body = yaml.safe_load((ROOT / "examples" / name).read_text())
    body["metadata"].update({"namespace": "ns1", "uid": "uid-1", "generation": 3, **meta})
    return dict(body)


def _pool(name: str = "kvpool-minimal.yaml", **spec: Any) -> KVPool:
    body = _load(name)
    body["spec"].update(spec)
    return KVPool.from_body(body)


def _pdd(**spec: Any) -> PDDeployment:
    body = _load("pddeployment-sim.yaml")
    body["spec"].update(spec)
    return PDDeployment.from_body(body)


def _by_kind(manifests: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [m for m in manifests if m["kind"] == kind]


# -- names and labels ------------------------------------------------------------------------
def test_dns_name_keeps_short_names_and_cuts_long_ones_stably() -> None:
    assert dns_name("pool", "agent") == "pool-agent"
    long = dns_name("p" * 80, "prefill")
    assert len(long) == 63 and long.endswith("-prefill")
    assert long == dns_name("p" * 80, "prefill")
    assert long != dns_name("p" * 79 + "q", "prefill")
    assert len(dns_name("x" * 300, "daybreak-agent", limit=253)) == 253


def test_standard_labels_and_owner_reference() -> None:
    labels = standard_labels(name="daybreak-engine", instance="d", component="decode", pool="p", deployment="d",
                             role="decode")
    assert labels == {
        "app.kubernetes.io/name": "daybreak-engine", "app.kubernetes.io/instance": "d",
        "app.kubernetes.io/component": "decode", "app.kubernetes.io/managed-by": "daybreak-operator",
        "daybreak.dev/pool": "p", "daybreak.dev/deployment": "d", "daybreak.dev/role": "decode",
    }
    ref = owner_reference({"apiVersion": "daybreak.dev/v1alpha1", "kind": "KVPool",
                           "metadata": {"name": "p", "uid": "u"}})
    assert ref == {"apiVersion": "daybreak.dev/v1alpha1", "kind": "KVPool", "name": "p", "uid": "u",
                   "controller": True, "blockOwnerDeletion": True}


# -- KVPool children --------------------------------------------------------------------------
def test_pool_children_and_agent_privileges() -> None:
    # The production example (rdma, an SSD tier): every host path an agent can get.
    pool = _pool("kvpool-production.yaml")
    out = pool_mod.build(pool, image=IMAGE)
    kinds = [m["kind"] for m in out.applied]
    assert kinds == ["ServiceAccount", "Role", "RoleBinding", "ConfigMap", "Service", "DaemonSet"]
    (ds,) = _by_kind(out.applied, "DaemonSet")
    pod = ds["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"daybreak.dev/accelerator": "sunrise", "daybreak.dev/rdma": "true"}
    assert pod["tolerations"] == [{"key": "daybreak.dev/dedicated", "operator": "Equal", "value": "inference",
                                   "effect": "NoSchedule"}]
    assert pod["serviceAccountName"] == "kv-production-daybreak-agent"
    (agent,) = pod["containers"]
    assert agent["command"] == ["daybreak", "agent", "--config", "/etc/daybreak/agent.yaml"]
    assert agent["image"] == IMAGE
    assert agent["securityContext"]["capabilities"] == {"add": ["IPC_LOCK"], "drop": ["ALL"]}
    assert agent["securityContext"]["privileged"] is False
    mounts = {m["mountPath"]: m for m in agent["volumeMounts"]}
    assert mounts["/host/sys"]["readOnly"] is True
    assert set(mounts) == {"/host/sys", "/dev/shm", "/etc/daybreak", "/var/run/daybreak/token", "/tmp",
                           "/mnt/nvme0/daybreak", "/dev/infiniband"}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["host-sys"]["hostPath"]["path"] == "/sys"
    assert volumes["ssd"]["hostPath"] == {"path": "/mnt/nvme0/daybreak", "type": "DirectoryOrCreate"}
    assert volumes["token"]["secret"]["secretName"] == "kv-production-token"
    assert agent["readinessProbe"]["tcpSocket"]["port"] == "store"
    assert agent["resources"] == {"limits": {"memory": "260Gi"}, "requests": {"cpu": "2", "memory": "260Gi"}}
    assert out.token_secret is not None and out.token_secret["metadata"]["name"] == "kv-production-token"
    # rdma: root, with IPC_LOCK as its only capability (see operator/pool.py).
    assert pod["securityContext"]["runAsUser"] == 0 and "initContainers" not in pod
    (role,) = _by_kind(out.applied, "Role")
    # Its own pool, and what the credential minter needs: see PDDeployments, create (never read) Secrets.
    assert role["rules"] == [{"apiGroups": ["daybreak.dev"], "resources": ["kvpools"],
                              "resourceNames": ["kv-production"], "verbs": ["get", "list", "watch"]},
                             {"apiGroups": ["daybreak.dev"], "resources": ["pddeployments"],
                              "verbs": ["list", "watch"]},
                             {"apiGroups": [""], "resources": ["secrets"], "verbs": ["create"]}]


def test_pool_without_rdma_or_ssd_mounts_neither() -> None:
    pool = _pool(transport={"preference": ["shm", "tcp"]})
    (ds,) = _by_kind(pool_mod.build(pool, image=IMAGE).applied, "DaemonSet")
    mounts = {m["mountPath"] for m in ds["spec"]["template"]["spec"]["containers"][0]["volumeMounts"]}
    assert "/dev/infiniband" not in mounts
    assert mounts == {"/host/sys", "/dev/shm", "/etc/daybreak", "/var/run/daybreak/token", "/tmp"}


def test_pool_config_is_valid_agent_settings_and_hash_follows_it() -> None:
    pool = _pool("kvpool-production.yaml")
    out = pool_mod.build(pool, image=IMAGE)
    (cm,) = _by_kind(out.applied, "ConfigMap")
    settings = AgentSettings.model_validate(yaml.safe_load(cm["data"]["agent.yaml"]))
    assert settings.dram_bytes == 256 * 2**30
    assert settings.ssd_bytes == 3 * 2**40 and settings.ssd_path == "/mnt/nvme0/daybreak"
    assert settings.replicas == 2 and settings.pool_name == "kv-production" and settings.pool_namespace == "ns1"
    assert settings.eviction_policy == "s3fifo" and settings.high_watermark == 0.92
    assert settings.listen == "0.0.0.0:7400"
    assert "hugePages" not in json.loads(cm["data"]["pool.json"])["tiers"]["dram"]  # removed from the API
    (ds,) = _by_kind(out.applied, "DaemonSet")
    hash1 = ds["spec"]["template"]["metadata"]["annotations"][pool_mod.CONFIG_HASH_ANNOTATION]
    changed = _pool("kvpool-production.yaml", leaseSeconds=20)
    (ds2,) = _by_kind(pool_mod.build(changed, image=IMAGE).applied, "DaemonSet")
    assert ds2["spec"]["template"]["metadata"]["annotations"][pool_mod.CONFIG_HASH_ANNOTATION] != hash1


def test_pool_with_secret_ref_generates_no_token() -> None:
    pool = _pool(auth={"secretRef": {"name": "mine"}})
    out = pool_mod.build(pool, image=IMAGE)
    assert out.token_secret is None
    (ds,) = _by_kind(out.applied, "DaemonSet")
    volumes = {v["name"]: v for v in ds["spec"]["template"]["spec"]["volumes"]}
    assert volumes["token"]["secret"]["secretName"] == "mine"


def _ready_pod(node: str, ip: str, ready: bool = True) -> dict[str, Any]:
    return {"metadata": {"name": f"a-{node}"}, "spec": {"nodeName": node},
            "status": {"podIP": ip, "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}}


def test_pool_status_sums_reports_and_falls_back_to_the_spec() -> None:
    pool = _pool()
    ds = {"status": {"desiredNumberScheduled": 2, "numberReady": 2}}
    pods = [_ready_pod("n0", "10.0.0.1"), _ready_pod("n1", "10.0.0.2")]
    reports = [pool_mod.AgentReport("n0", {"dram": 100, "ssd": 7}, {"dram": 40})]
    st = pool_mod.status(pool, daemonset=ds, pods=pods, reports=reports, existing=None, generation=3)
    assert st["nodes"] == {"desired": 2, "ready": 2}
    assert st["capacity"] == {"hbm": 0, "dram": 100 + 8 * 2**30, "ssd": 7}
    assert st["used"] == {"hbm": 0, "dram": 40, "ssd": 0}
    assert [e["node"] for e in st["endpoints"]] == ["n0", "n1"]
    assert st["endpoints"][0]["port"] == 7400
    ready = cond.find(st["conditions"], "Ready")
    assert ready is not None and ready["status"] == "True" and ready["observedGeneration"] == 3
    assert st["observedGeneration"] == 3


def test_pool_status_conditions_name_the_problem() -> None:
    pool = _pool()
    none = pool_mod.status(pool, daemonset={"status": {"desiredNumberScheduled": 0}}, pods=[], reports=[],
                           existing=None, generation=1)
    assert cond.find(none["conditions"], "Ready")["reason"] == "NoNodesSelected"  # type: ignore[index]
    partial = pool_mod.status(pool, daemonset={"status": {"desiredNumberScheduled": 2}},
                              pods=[_ready_pod("n0", "1.1.1.1"), _ready_pod("n1", "1.1.1.2", ready=False)],
                              reports=[], existing=None, generation=1)
    assert cond.find(partial["conditions"], "Ready")["reason"] == "AgentsNotReady"  # type: ignore[index]
    degraded = cond.find(partial["conditions"], "Degraded")
    assert degraded is not None and degraded["status"] == "True" and degraded["reason"] == "AgentsUnavailable"
    assert partial["nodes"] == {"desired": 2, "ready": 1}


# -- PDDeployment children -------------------------------------------------------------------------
def test_pdd_children_env_and_labels() -> None:
    pdd, pool = _pdd(), _pool()
    out = pdd_mod.build(pdd, pool, image=IMAGE)
    names = [(m["kind"], m["metadata"]["name"]) for _, m in out.applied]
    assert names == [("Deployment", "sim-llama-prefill"), ("Service", "sim-llama-prefill"),
                     ("Deployment", "sim-llama-decode"), ("Service", "sim-llama-decode"),
                     ("Deployment", "sim-llama-router"), ("Service", "sim-llama")]
    decode = next(m for role, m in out.applied if role == Role.DECODE and m["kind"] == "Deployment")
    assert decode["spec"]["replicas"] == 2
    assert decode["spec"]["selector"]["matchLabels"] == {"daybreak.dev/deployment": "sim-llama",
                                                         "daybreak.dev/role": "decode"}
    assert decode["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}
    container = decode["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e for e in container["env"]}
    layout = KVLayout(num_layers=32, num_kv_heads=8, head_dim=128)
    expected_ns = kv_namespace(model_name="meta-llama/Llama-3.1-8B-Instruct",
                               model_revision="0e9e39f249a16976918f6564b8830bc894c89659", layout=layout,
                               engine="sim")
    assert env["DAYBREAK_KV_NAMESPACE"]["value"] == expected_ns
    assert env["DAYBREAK_ROLE"]["value"] == "decode"
    assert env["DAYBREAK_POOL_ENDPOINTS"]["value"] == "kv-minimal-agents.ns1.svc:7400"
    assert env["DAYBREAK_POOL_TOKEN"]["valueFrom"] == {"secretKeyRef": {
        "name": credential_secret_name(pdd.metadata.name or "", pdd.spec.kv_namespace()), "key": "token",
        "optional": False}}
    assert env["DAYBREAK_TRANSPORTS"]["value"] == "shm,link,tcp"
    assert env["DAYBREAK_BLOCK_BYTES"]["value"] == str(layout.bytes_per_block)
    assert container["command"][:4] == ["daybreak", "sim-engine", "--role", "decode"]
    labels = decode["spec"]["template"]["metadata"]["labels"]
    assert labels["daybreak.dev/pool"] == "kv-minimal" and labels["app.kubernetes.io/component"] == "decode"
    services = {m["metadata"]["name"]: m for _, m in out.applied if m["kind"] == "Service"}
    assert services["sim-llama-decode"]["spec"]["clusterIP"] == "None"
    assert "clusterIP" not in services["sim-llama"]["spec"]


def test_pdd_user_env_and_template_merge_without_losing_selector_labels() -> None:
    # (A DAYBREAK_* variable is the operator's and refused: tests/operator/test_pool_policy_units.py.)
    pdd = _pdd(engine={"kind": "sim", "env": [{"name": "POD_NAME", "value": "override"},
                                              {"name": "EXTRA", "value": "1"}]},
               decode={"replicas": 1, "template": {
                   "metadata": {"labels": {"daybreak.dev/role": "hijack", "team": "a"}},
                   "spec": {"tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists"}],
                            "containers": [{"name": "engine", "imagePullPolicy": "Always"}]}}})
    out = pdd_mod.build(pdd, _pool(), image=IMAGE)
    decode = next(m for role, m in out.applied if role == Role.DECODE and m["kind"] == "Deployment")
    template = decode["spec"]["template"]
    assert template["metadata"]["labels"]["daybreak.dev/role"] == "decode"
    assert template["metadata"]["labels"]["team"] == "a"
    assert template["spec"]["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists"}]
    (container,) = template["spec"]["containers"]
    assert container["imagePullPolicy"] == "Always" and container["command"][1] == "sim-engine"
    env = [e["name"] for e in container["env"]]
    assert env.count("POD_NAME") == 1 and env[-2:] == ["POD_NAME", "EXTRA"]


def test_pdd_revision_follows_the_pod_template_not_the_replicas() -> None:
    pool = _pool()
    base = pdd_mod.build(_pdd(), pool, image=IMAGE).revision
    assert pdd_mod.build(_pdd(decode={"replicas": 5}), pool, image=IMAGE).revision == base
    model = {"name": "meta-llama/Llama-3.1-8B-Instruct", "revision": "other",
             "kvLayout": {"numLayers": 32, "numKVHeads": 8, "headDim": 128}}
    assert pdd_mod.build(_pdd(model=model), pool, image=IMAGE).revision != base


def test_pdd_router_disabled_builds_no_router() -> None:
    out = pdd_mod.build(_pdd(router={"enabled": False}), _pool(), image=IMAGE)
    assert all(role != Role.ROUTER for role, _ in out.applied)
    assert out.router_names == ("sim-llama-router", "sim-llama")


def _workload(replicas: int, ready: int, updated: int | None = None, generation: int = 1) -> dict[str, Any]:
    updated = replicas if updated is None else updated
    return {"metadata": {"generation": generation},
            "status": {"observedGeneration": generation, "replicas": replicas, "readyReplicas": ready,
                       "updatedReplicas": updated, "availableReplicas": ready}}


def test_pdd_status_pool_not_found_and_ready() -> None:
    pdd = _pdd()
    missing = pdd_mod.status(pdd, pool=None, workloads={}, revision=None, existing=None, generation=3)
    ready = cond.find(missing["conditions"], "Ready")
    assert ready is not None and ready["status"] == "False" and ready["reason"] == "PoolNotFound"
    assert "kv-minimal" in ready["message"]
    assert missing["kvNamespace"] == pdd.spec.kv_namespace()
    ok = pdd_mod.status(pdd, pool=_pool(), workloads={Role.PREFILL: _workload(1, 1), Role.DECODE: _workload(2, 2),
                                                     Role.ROUTER: _workload(1, 1)},
                        revision="abc", existing=missing, generation=3)
    assert cond.find(ok["conditions"], "Ready")["status"] == "True"  # type: ignore[index]
    assert cond.find(ok["conditions"], "Progressing")["status"] == "False"  # type: ignore[index]
    assert ok["decode"] == {"replicas": 2, "readyReplicas": 2, "updatedReplicas": 2}
    assert ok["revision"] == "abc" and ok["observedGeneration"] == 3
    rolling = pdd_mod.status(pdd, pool=_pool(), workloads={Role.PREFILL: _workload(1, 1),
                                                          Role.DECODE: _workload(3, 2, updated=1),
                                                          Role.ROUTER: _workload(1, 1)},
                             revision="def", existing=ok, generation=4)
    progressing = cond.find(rolling["conditions"], "Progressing")
    assert progressing is not None and progressing["status"] == "True" and "decode" in progressing["message"]


# -- conditions, queue, settings ---------------------------------------------------------------------
def test_condition_merge_moves_transition_time_only_on_status_change() -> None:
    first = cond.merge(None, [cond.Condition(type="Ready", status="False", reason="A")], generation=1, now="t1")
    same = cond.merge([*first, {"type": "Foreign", "status": "True"}],
                      [cond.Condition(type="Ready", status="False", reason="B", message="m")], generation=2, now="t2")
    assert same[0]["lastTransitionTime"] == "t1" and same[0]["reason"] == "B" and same[0]["observedGeneration"] == 2
    assert same[1] == {"type": "Foreign", "status": "True"}
    flipped = cond.merge(same, [cond.Condition(type="Ready", status="True", reason="C")], generation=2, now="t3")
    assert flipped[0]["lastTransitionTime"] == "t3"


def test_work_queue_dedups_and_never_hands_a_key_to_two_workers() -> None:
    async def scenario() -> None:
        q: WorkQueue[str] = WorkQueue(base_delay=0.01, max_delay=0.04)
        q.add("a")
        q.add("a")
        q.add("b")
        assert len(q) == 2
        key = await q.get()
        assert key == "a"
        q.add("a")  # while "a" is in flight: queued again only after done()
        assert await q.get() == "b"
        assert len(q) == 0
        q.done("a")
        assert await q.get() == "a"
        q.done("a")
        q.done("b")
        delays = [q.add_rate_limited("c") for _ in range(4)]
        assert delays == [0.01, 0.02, 0.04, 0.04]
        assert await asyncio.wait_for(q.get(), timeout=5) == "c"
        q.forget("c")
        assert q.failures("c") == 0

    asyncio.run(scenario())


def test_lease_timing_and_settings_reject_bad_values_naming_them() -> None:
    with pytest.raises(ValueError, match="renew_deadline"):
        LeaseTiming(lease_duration=5, renew_deadline=6, retry_period=1)
    with pytest.raises(ValueError, match="namespace and all_namespaces"):
        OperatorSettings.load(overrides={"namespace": "a", "all_namespaces": True}, environ={})
    with pytest.raises(ValueError, match="workers"):
        OperatorSettings.load(overrides={"workers": 0}, environ={})
    s = OperatorSettings.load(overrides={"resync_seconds": None}, environ={"DAYBREAK_OPERATOR_RESYNC_SECONDS": "3"})
    assert s.resync_seconds == 3.0 and s.clusterwide


def test_applier_skips_only_children_nobody_touched_since_our_apply() -> None:
    from daybreak.operator.children import Applier
    from daybreak.operator.events import EventRecorder

    class Client:
        """Stands in for the API server's apply: echoes the body with a generation."""

        def __init__(self) -> None:
            self.calls = 0

        async def apply(self, body: dict[str, Any]) -> tuple[dict[str, Any], bool]:
            self.calls += 1
            live = json.loads(json.dumps(body))
            live["metadata"]["generation"] = 1
            return live, self.calls == 1

    cache: dict[str, Any] = {}
    client = Client()
    applier = Applier(client, events=EventRecorder(client), fence=lambda: True,  # type: ignore[arg-type]
                      cache=lambda kind, ns, name: cache.get(name))
    parent = {"apiVersion": "daybreak.dev/v1alpha1", "kind": "PDDeployment",
              "metadata": {"name": "p", "namespace": "ns", "uid": "u1"}}
    child = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "p-decode"},
             "spec": {"replicas": 2}}
    labels = {"daybreak.dev/role": "decode"}

    async def scenario() -> None:
        first = await applier.apply(parent, child, labels=labels)
        assert first.outcome == "created" and client.calls == 1
        cache["p-decode"] = first.obj
        assert (await applier.apply(parent, child, labels=labels)).outcome == "skipped"
        assert client.calls == 1
        cache["p-decode"] = {**first.obj, "metadata": {**first.obj["metadata"], "generation": 2}}  # kubectl scale
        await applier.apply(parent, child, labels=labels)
        assert client.calls == 2
        cache["p-decode"] = {**first.obj, "metadata": {**first.obj["metadata"], "labels": {}}}  # labels removed
        await applier.apply(parent, child, labels=labels)
        assert client.calls == 3
        cache["p-decode"] = first.obj
        await applier.apply(parent, {**child, "spec": {"replicas": 3}}, labels=labels)  # a new desired state
        assert client.calls == 4
        service = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "p-decode"}, "spec": {}}
        await applier.apply(parent, service, labels=labels)
        await applier.apply(parent, service, labels=labels)  # not watched: always applied
        assert client.calls == 6

    asyncio.run(scenario())


def _drain(queue: WorkQueue[Any]) -> list[Any]:
    """The keys queued right now, in order (each handed out and marked done)."""

    async def drain() -> list[Any]:
        keys = []
        while len(queue):
            key = await queue.get()
            queue.done(key)
            keys.append(key)
        return keys

    return asyncio.run(drain())


def test_the_watch_intake_asks_for_full_reconciles_on_spec_changes_and_status_refreshes_otherwise() -> None:
    from daybreak.operator.kopf_adapter import EventIntake
    from daybreak.operator.state import PDD, POOL, TermState

    state = TermState(namespaces=("ns",), max_backoff_seconds=1.0)
    forgotten: list[tuple[str, str]] = []
    intake = EventIntake(state, forget_deployment=lambda ns, name: forgotten.append((ns, name)))
    pool_key, pdd_key = (POOL, "ns", "p"), (PDD, "ns", "d")

    def pool(generation: int, rv: str) -> dict[str, Any]:
        return {"kind": "KVPool", "metadata": {"namespace": "ns", "name": "p", "generation": generation,
                                               "resourceVersion": rv}}

    intake.on_pool_event("ADDED", pool(1, "1"))
    intake.on_pdd_event("ADDED", {"kind": "PDDeployment", "spec": {"poolRef": {"name": "p"}},
                                  "metadata": {"namespace": "ns", "name": "d", "generation": 1, "resourceVersion": "2"}})
    assert _drain(state.queue) == [pool_key, pdd_key] and state.needs_apply == {pool_key, pdd_key}
    state.needs_apply.clear()

    state.own_status_rv[pool_key] = "3"
    intake.on_pool_event("MODIFIED", pool(1, "3"))  # the echo of our own status write: nothing to do
    assert _drain(state.queue) == [] and not state.needs_apply
    intake.on_pool_event("MODIFIED", pool(2, "4"))  # a spec change: the pool and its deployments re-apply
    assert _drain(state.queue) == [pdd_key, pool_key] and state.needs_apply == {pool_key, pdd_key}
    state.needs_apply.clear()

    child = {"kind": "Deployment", "metadata": {
        "namespace": "ns", "name": "d-decode", "generation": 1,
        "ownerReferences": [{"apiVersion": "daybreak.dev/v1alpha1", "kind": "PDDeployment", "name": "d",
                             "controller": True}]}}
    intake.on_child_event("ADDED", child)
    intake.on_child_event("MODIFIED", {**child, "status": {"readyReplicas": 1}})  # status only: a refresh
    assert _drain(state.queue) == [pdd_key] and not state.needs_apply
    assert state.children[("Deployment", "ns", "d-decode")]["status"] == {"readyReplicas": 1}
    intake.on_child_event("MODIFIED", {**child, "metadata": {**child["metadata"], "generation": 2}})  # hand edit
    assert _drain(state.queue) == [pdd_key] and state.needs_apply == {pdd_key}
    state.needs_apply.clear()
    intake.on_child_event("DELETED", child)  # drift: put it back now
    assert _drain(state.queue) == [pdd_key] and state.needs_apply == {pdd_key}
    assert ("Deployment", "ns", "d-decode") not in state.children
    state.needs_apply.clear()

    intake.on_pool_event("ADDED", {"kind": "KVPool", "metadata": {"namespace": "other", "name": "p"}})
    intake.on_child_event("ADDED", {**child, "metadata": {**child["metadata"], "namespace": "other"}})
    assert _drain(state.queue) == [] and not state.needs_apply  # outside the watched namespaces

    intake.on_pdd_event("DELETED", {"kind": "PDDeployment", "metadata": {"namespace": "ns", "name": "d"}})
    assert forgotten == [("ns", "d")] and ("ns", "d") not in state.pdds and ("ns", "d") not in state.pool_of
    intake.on_pool_event("MODIFIED", pool(3, "5"))  # the deleted deployment is no dependent any more
    assert _drain(state.queue) == [pool_key]


def test_a_watch_event_older_than_our_own_write_never_replaces_the_cached_body() -> None:
    """The status writer caches what its write returned; the watch then delivers the events before that
    write. Such an event put the older body back, and the next reconcile saw a status field the write
    had set as unset (a flush requested again, freeing 0 bytes; reported from the upgrade e2e test)."""
    from daybreak.operator.kopf_adapter import EventIntake
    from daybreak.operator.state import PDD, TermState

    state = TermState(namespaces=(), max_backoff_seconds=1.0)
    intake = EventIntake(state, forget_deployment=lambda ns, name: None)
    key = (PDD, "ns", "d")

    def pdd(generation: int, rv: str, freed: int | None) -> dict[str, Any]:
        return {"kind": "PDDeployment", "spec": {"poolRef": {"name": "p"}},
                "metadata": {"namespace": "ns", "name": "d", "generation": generation, "resourceVersion": rv},
                "status": {"retiredKVNamespace": {"bytesFreed": freed}}}

    intake.on_pdd_event("ADDED", pdd(1, "98", None))
    _drain(state.queue)
    state.needs_apply.clear()
    state.cache_parent(key, pdd(1, "105", 4096))  # our write's answer (the status writer does this)
    state.own_status_rv[key] = "105"
    intake.on_pdd_event("MODIFIED", pdd(1, "99", None))  # an earlier status write, delivered late
    assert state.pdds[("ns", "d")]["status"]["retiredKVNamespace"]["bytesFreed"] == 4096
    assert _drain(state.queue) == [] and not state.needs_apply
    # A spec change made before our write: not cached (the write's answer holds it), but it is reconciled.
    intake.on_pdd_event("MODIFIED", pdd(2, "100", None))
    assert state.pdds[("ns", "d")]["metadata"]["resourceVersion"] == "105"
    assert _drain(state.queue) == [key] and state.needs_apply == {key}
    state.needs_apply.clear()
    intake.on_pdd_event("MODIFIED", pdd(1, "99", None))  # older than a generation already seen: nothing
    assert _drain(state.queue) == [] and not state.needs_apply
    intake.on_pdd_event("MODIFIED", pdd(2, "105", 4096))  # the echo of our write
    intake.on_pdd_event("MODIFIED", pdd(2, "1000", 0))  # a newer write (another length: compared as numbers)
    assert state.pdds[("ns", "d")]["metadata"]["resourceVersion"] == "1000"

    child = {"kind": "Deployment", "spec": {"replicas": 3}, "metadata": {
        "namespace": "ns", "name": "d-decode", "generation": 4, "resourceVersion": "200",
        "ownerReferences": [{"apiVersion": "daybreak.dev/v1alpha1", "kind": "PDDeployment", "name": "d",
                             "controller": True}]}}
    state.cache_applied([child])  # an apply's answer
    _drain(state.queue)
    intake.on_child_event("MODIFIED", {**child, "spec": {"replicas": 2},
                                       "metadata": {**child["metadata"], "generation": 3, "resourceVersion": "190"}})
    assert state.children[("Deployment", "ns", "d-decode")]["spec"] == {"replicas": 3}
    assert _drain(state.queue) == [] and not state.needs_apply


def test_planner_decisions_reach_the_deployments_next_reconcile_through_submit_scale() -> None:
    """The autoscaler holds only a ``submit_scale`` callable: the decision is queued as a full reconcile and
    written into status (desiredReplicas, lastScale, an Event) by that reconcile, not by the planner."""
    from daybreak.operator.autoscaler import Autoscaler
    from daybreak.operator.deployment_reconciler import DeploymentReconciler
    from daybreak.operator.planner import Decision
    from daybreak.operator.state import PDD, TermState

    state = TermState(namespaces=(), max_backoff_seconds=1.0)
    recorded: list[tuple[str, str]] = []

    class Events:
        def record(self, obj: dict[str, Any], *, reason: str, message: str, type: str = "Normal") -> None:
            recorded.append((reason, message))

    reconciler = DeploymentReconciler(None, state, settings=OperatorSettings(), applier=None,  # type: ignore[arg-type]
                                      events=Events(), status=None, rollout=None)  # type: ignore[arg-type]
    autoscaler = Autoscaler(None, deployments=state.pdds, check_leader=lambda: None,  # type: ignore[arg-type]
                            submit_scale=reconciler.submit_scale)
    decision = Decision(role="decode", current=2, desired=4, reason="itl above target", numbers={"itl": 0.05})
    autoscaler.submit_scale(namespace="ns", name="d", decisions=[decision])
    assert _drain(state.queue) == [(PDD, "ns", "d")] and state.needs_apply == {(PDD, "ns", "d")}

    body = {"metadata": {"namespace": "ns", "name": "d"}, "spec": {"autoscaling": {"enabled": True}}}
    seen = reconciler._with_scale("ns", "d", body)
    assert seen["status"]["decode"]["desiredReplicas"] == 4 and seen["status"]["lastScale"]["to"] == 4
    assert "status" not in body  # the stored body is untouched: the status write compares against it
    assert recorded == [("Autoscaled", "decode 2 -> 4: itl above target")]
    assert reconciler._with_scale("ns", "d", body)["status"].get("lastScale") is None  # handed over once
