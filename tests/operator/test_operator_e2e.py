"""The operator end to end: real operator processes against the full local cluster (controllers, scheduler, kwok).

One scenario in steps, sharing a namespace and two operator replicas: apply a
pool and a deployment, check every child, the agents' placement and the
status; then drift, scaling, rollout, invalid references, the agents' node
restriction, leader hand-over by SIGKILL, and garbage collection.
"""

from __future__ import annotations

import signal
import ssl
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest
import yaml

from daybreak.agent.settings import AgentSettings
from daybreak.api.pddeployment import PDDeployment
from daybreak.devenv.cluster import ClusterSpec, LocalCluster, fake_node
from daybreak.pool.engine_secret import credential_secret_name
from daybreak.testing import e2e
from daybreak.testing.operator_process import OperatorProcess

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
NS = "op-e2e"
CPU_NODE = "daybreak-cpu-0"
ACCEL_NODES = {"daybreak-node-0", "daybreak-node-1"}
RESYNC = 3.0
T = TypeVar("T")


def wait_for(what: str, probe: Callable[[], T | None], *, timeout: float = 60.0, env: Env | None = None) -> T:
    """Poll ``probe`` until it returns something truthy; fail naming ``what`` (and the operators' logs)."""
    diagnose = None if env is None else (
        lambda: "\n".join(f"--- {o.identity} ---\n{o.log()[-3000:]}" for o in env.operators))
    return e2e.wait_for(what, probe, timeout=timeout, diagnose=diagnose)


@dataclass
class Env:
    cluster: LocalCluster
    api: httpx.Client
    operators: list[OperatorProcess]

    def get(self, path: str) -> dict[str, Any] | None:
        resp = self.api.get(path)
        if resp.status_code == 404:
            return None
        resp.raise_for_status()
        return dict(resp.json())

    def apply(self, manifest: dict[str, Any]) -> None:
        self.cluster.kubectl("apply", "-n", NS, "-f", "-", stdin=yaml.safe_dump(manifest))

    def pdd(self, name: str) -> dict[str, Any] | None:
        return self.get(f"/apis/daybreak.dev/v1alpha1/namespaces/{NS}/pddeployments/{name}")

    def pool(self, name: str) -> dict[str, Any] | None:
        return self.get(f"/apis/daybreak.dev/v1alpha1/namespaces/{NS}/kvpools/{name}")

    def deployment(self, name: str) -> dict[str, Any] | None:
        return self.get(f"/apis/apps/v1/namespaces/{NS}/deployments/{name}")

    def leader(self) -> str:
        lease = self.get(f"/apis/coordination.k8s.io/v1/namespaces/{NS}/leases/daybreak-operator")
        return str(((lease or {}).get("spec") or {}).get("holderIdentity") or "")

    def operator(self, identity_prefix: str) -> OperatorProcess:
        return next(o for o in self.operators if identity_prefix.startswith(o.identity + "_"))

    def events(self, name: str) -> list[dict[str, Any]]:
        items = (self.get(f"/api/v1/namespaces/{NS}/events?fieldSelector=involvedObject.name={name}") or {})
        return list(items.get("items") or [])


def condition(obj: dict[str, Any] | None, type_: str) -> dict[str, Any]:
    for c in ((obj or {}).get("status") or {}).get("conditions") or []:
        if c.get("type") == type_:
            return dict(c)
    return {}


def pool_manifest(name: str, **spec: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "apiVersion": "daybreak.dev/v1alpha1", "kind": "KVPool", "metadata": {"name": name},
        "spec": {"nodeSelector": {"daybreak.dev/accelerator": "sunrise"},
                 "tiers": {"dram": {"bytesPerNode": "1Gi"}},
                 "transport": {"preference": ["rdma", "shm", "tcp"]}},
    }
    body["spec"].update(spec)
    return body


def pdd_manifest(name: str, pool: str, **spec: Any) -> dict[str, Any]:
    body = yaml.safe_load((ROOT / "examples" / "pddeployment-sim.yaml").read_text())
    body["metadata"] = {"name": name}
    body["spec"]["poolRef"] = {"name": pool}
    body["spec"].update(spec)
    return dict(body)


@pytest.fixture(scope="module")
def env(cluster: LocalCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    logs = tmp_path_factory.mktemp("operator-e2e")
    ns = e2e.E2ENamespace(cluster, NS).open()
    api = ns.client
    # A node without accelerators: the pool's agents must stay off it.
    resp = api.post("/api/v1/nodes", json=fake_node(CPU_NODE, ClusterSpec(devices_per_node=0)))
    assert resp.status_code in (201, 409), resp.text
    operators = [OperatorProcess(kubeconfig=cluster.kubeconfig, log_path=logs / f"op-{x}.log", namespace=NS,
                                 identity=f"op-{x}", lease_namespace=NS, resync_seconds=RESYNC)
                 for x in ("a", "b")]
    e = Env(cluster, api, operators)
    try:
        operators[0].start()
        wait_for("op-a to lead", lambda: e.leader().startswith("op-a_"), timeout=90, env=e)
        operators[1].start()
        wait_for("op-b to serve metrics", lambda: operators[1].metric("daybreak_operator_leader") == 0.0
                 and "daybreak_operator_leader" in operators[1].metrics(), env=e)
        e.apply(pool_manifest("pool-a"))
        e.apply(pdd_manifest("sim-a", "pool-a"))
        yield e
    finally:
        for op in operators:
            op.stop()
        cluster.kubectl("delete", "node", CPU_NODE, "--wait=false", check=False)
        ns.close()


def _owned_by(obj: dict[str, Any], parent: dict[str, Any]) -> bool:
    refs = obj["metadata"].get("ownerReferences") or []
    return any(r["uid"] == parent["metadata"]["uid"] and r.get("controller") for r in refs)


def test_every_child_exists_with_owner_labels_env_and_mounts(env: Env) -> None:
    pool = wait_for("pool-a", lambda: env.pool("pool-a"), env=env)
    pdd = wait_for("sim-a", lambda: env.pdd("sim-a"), env=env)
    paths = {
        "ServiceAccount": f"/api/v1/namespaces/{NS}/serviceaccounts/pool-a-daybreak-agent",
        "Role": f"/apis/rbac.authorization.k8s.io/v1/namespaces/{NS}/roles/pool-a-agent",
        "RoleBinding": f"/apis/rbac.authorization.k8s.io/v1/namespaces/{NS}/rolebindings/pool-a-agent",
        "ConfigMap": f"/api/v1/namespaces/{NS}/configmaps/pool-a-agent-config",
        "Secret": f"/api/v1/namespaces/{NS}/secrets/pool-a-token",
        "Service": f"/api/v1/namespaces/{NS}/services/pool-a-agents",
        "DaemonSet": f"/apis/apps/v1/namespaces/{NS}/daemonsets/pool-a-agent",
    }
    pool_children = {kind: wait_for(kind, lambda p=path: env.get(p), env=env) for kind, path in paths.items()}
    for kind, child in pool_children.items():
        assert _owned_by(child, pool), kind
        labels = child["metadata"]["labels"]
        assert labels["app.kubernetes.io/managed-by"] == "daybreak-operator", kind
        assert labels["daybreak.dev/pool"] == "pool-a" and labels["app.kubernetes.io/name"] == "daybreak-agent"
    agent = {"kind": "ServiceAccount", "name": "pool-a-daybreak-agent", "namespace": NS}
    binding = wait_for("agent in the shared ClusterRoleBinding", lambda: (b := env.get(
        "/apis/rbac.authorization.k8s.io/v1/clusterrolebindings/daybreak-agents")) and agent in (b.get("subjects") or [])
        and b, env=env)
    assert binding["roleRef"]["name"] == "daybreak-agent"

    ds = pool_children["DaemonSet"]
    pod = ds["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"daybreak.dev/accelerator": "sunrise"}
    container = pod["containers"][0]
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    assert mounts["/host/sys"].get("readOnly") is True
    assert {"/dev/shm", "/dev/infiniband", "/etc/daybreak", "/var/run/daybreak/token"} <= set(mounts)
    assert "IPC_LOCK" in container["securityContext"]["capabilities"]["add"]
    assert container["command"][:2] == ["daybreak", "agent"]
    config = AgentSettings.model_validate(yaml.safe_load(pool_children["ConfigMap"]["data"]["agent.yaml"]))
    assert config.dram_bytes == 2**30 and config.pool_name == "pool-a"

    roles = {r: wait_for(r, lambda r=r: env.deployment(f"sim-a-{r}"), env=env) for r in ("prefill", "decode",
                                                                                          "router")}
    for svc in ("sim-a-prefill", "sim-a-decode", "sim-a"):
        service = wait_for(svc, lambda s=svc: env.get(f"/api/v1/namespaces/{NS}/services/{s}"), env=env)
        assert _owned_by(service, pdd)
    for role, workload in roles.items():
        assert _owned_by(workload, pdd), role
        labels = workload["spec"]["template"]["metadata"]["labels"]
        assert labels["daybreak.dev/deployment"] == "sim-a" and labels["daybreak.dev/role"] == role
        assert labels["daybreak.dev/pool"] == "pool-a"
    assert roles["decode"]["spec"]["replicas"] == 2
    engine_env = {e["name"]: e for e in roles["decode"]["spec"]["template"]["spec"]["containers"][0]["env"]}
    expected_ns = PDDeployment.from_body(pdd).spec.kv_namespace()
    assert engine_env["DAYBREAK_KV_NAMESPACE"]["value"] == expected_ns
    assert engine_env["DAYBREAK_POOL_ENDPOINTS"]["value"] == f"pool-a-agents.{NS}.svc:7400"
    assert engine_env["DAYBREAK_POOL_TOKEN"]["valueFrom"]["secretKeyRef"] == {
        "name": credential_secret_name("sim-a", expected_ns), "key": "token", "optional": False}
    assert engine_env["DAYBREAK_TRANSPORTS"]["value"] == "rdma,shm,tcp"
    assert engine_env["DAYBREAK_ROLE"]["value"] == "decode"


def test_agents_run_only_on_accelerator_nodes_and_status_fills_in(env: Env) -> None:
    def agent_nodes() -> set[str] | None:
        pods = env.get(f"/api/v1/namespaces/{NS}/pods?labelSelector=daybreak.dev/pool=pool-a,"
                       "app.kubernetes.io/component=agent") or {}
        running = {p["spec"].get("nodeName") for p in pods.get("items", []) if p["status"].get("phase") == "Running"}
        return running if len(running) >= 2 else None

    assert wait_for("agent pods Running", agent_nodes, timeout=90, env=env) == ACCEL_NODES
    pool = wait_for("pool Ready", lambda: (p := env.pool("pool-a")) and condition(p, "Ready").get("status") == "True"
                    and p, timeout=90, env=env)
    status = pool["status"]
    assert status["nodes"] == {"desired": 2, "ready": 2}
    assert sorted(e["node"] for e in status["endpoints"]) == sorted(ACCEL_NODES)
    assert status["capacity"]["dram"] >= 2 * 2**30
    assert status["observedGeneration"] == pool["metadata"]["generation"]
    # Endpoint transports are what each agent reports running (its KVNode), not the spec's list: rdma is
    # listed but no node here has an RDMA NIC, so the agents run shm and tcp.
    measured = wait_for("endpoints with the agents' own transports",
                        lambda: (p := env.pool("pool-a")) and p["status"]["endpoints"]
                        and all(e.get("transports") for e in p["status"]["endpoints"]) and p["status"]["endpoints"],
                        timeout=120, env=env)
    assert [e["transports"] for e in measured] == [["shm", "tcp"]] * 2

    pdd = wait_for("sim-a Ready", lambda: (p := env.pdd("sim-a")) and condition(p, "Ready").get("status") == "True"
                   and p, timeout=120, env=env)
    st = pdd["status"]
    assert st["prefill"]["readyReplicas"] == 1 and st["decode"]["readyReplicas"] == 2
    assert st["router"]["readyReplicas"] == 1
    assert st["kvNamespace"] == PDDeployment.from_body(pdd).spec.kv_namespace()
    assert st["revision"] and st["observedGeneration"] == pdd["metadata"]["generation"]
    assert condition(pdd, "Degraded")["status"] == "False"
    assert condition(pdd, "Ready")["observedGeneration"] == pdd["metadata"]["generation"]
    out = env.cluster.kubectl("get", "pdd", "-n", NS, "sim-a").stdout
    assert "sim-a" in out and "True" in out


def test_drift_is_restored(env: Env) -> None:
    decode = wait_for("decode", lambda: env.deployment("sim-a-decode"), env=env)
    env.cluster.kubectl("delete", "deployment", "-n", NS, "sim-a-decode", "--wait=false")
    wait_for("decode re-created", lambda: (d := env.deployment("sim-a-decode"))
             and d["metadata"]["uid"] != decode["metadata"]["uid"], env=env)

    env.cluster.kubectl("scale", "deployment", "-n", NS, "sim-a-decode", "--replicas=5")
    wait_for("decode replicas back to 2", lambda: (d := env.deployment("sim-a-decode"))
             and d["spec"]["replicas"] == 2, env=env)

    cm_path = f"/api/v1/namespaces/{NS}/configmaps/pool-a-agent-config"
    cm = wait_for("agent config", lambda: env.get(cm_path), env=env)
    env.cluster.kubectl("delete", "configmap", "-n", NS, "pool-a-agent-config")
    restored = wait_for("agent config re-created within a re-sync", lambda: (c := env.get(cm_path))
                        and c["metadata"]["uid"] != cm["metadata"]["uid"] and c, timeout=RESYNC * 10, env=env)
    assert restored["data"] == cm["data"]

    token_path = f"/api/v1/namespaces/{NS}/secrets/pool-a-token"
    token = wait_for("token", lambda: env.get(token_path), env=env)
    time.sleep(RESYNC * 2)  # two re-syncs: the generated token must not be rotated
    assert env.get(token_path)["data"] == token["data"]  # type: ignore[index]


def test_scale_and_rollout_are_applied_with_events(env: Env) -> None:
    old = wait_for("sim-a status", lambda: (p := env.pdd("sim-a")) and p["status"].get("revision") and p, env=env)
    env.cluster.kubectl("patch", "pdd", "-n", NS, "sim-a", "--type=merge",
                        "-p", '{"spec":{"decode":{"replicas":3,"maxReplicas":3}}}')
    wait_for("decode scaled to 3", lambda: (d := env.deployment("sim-a-decode")) and d["spec"]["replicas"] == 3,
             env=env)
    wait_for("Scaled event", lambda: any(e["reason"] == "Scaled" and "decode from 2 to 3" in e["message"]
                                         for e in env.events("sim-a")), env=env)
    env.cluster.kubectl("patch", "pdd", "-n", NS, "sim-a", "--type=merge",
                        "-p", '{"spec":{"model":{"revision":"new-weights"}}}')
    new = wait_for("new revision in status", lambda: (p := env.pdd("sim-a"))
                   and p["status"].get("revision") != old["status"]["revision"]
                   and p["status"].get("observedGeneration") == p["metadata"]["generation"] and p, env=env)
    assert new["status"]["kvNamespace"] != old["status"]["kvNamespace"]
    assert new["status"]["kvNamespace"] == PDDeployment.from_body(new).spec.kv_namespace()
    # Prefill rolls first (its new pods wait for the agents to mint the new namespace's credential
    # Secret, then for /health); decode follows once prefill runs only the new template.
    def decode_namespace() -> str | None:
        decode = env.deployment("sim-a-decode") or {}
        containers = (((decode.get("spec") or {}).get("template") or {}).get("spec") or {}).get("containers") or [{}]
        return {e["name"]: e.get("value") for e in containers[0].get("env") or []}.get("DAYBREAK_KV_NAMESPACE")

    wait_for("decode on the new kvNamespace", lambda: decode_namespace() == new["status"]["kvNamespace"], env=env)
    assert env.get(f"/api/v1/namespaces/{NS}/secrets/{credential_secret_name('sim-a', new['status']['kvNamespace'])}")
    wait_for("RolloutStarted event", lambda: any(e["reason"] == "RolloutStarted" for e in env.events("sim-a")),
             env=env)


def test_missing_pool_waits_then_recovers_and_a_bad_secret_ref_is_reported(env: Env) -> None:
    env.apply(pdd_manifest("sim-late", "pool-late"))
    pdd = wait_for("PoolNotFound", lambda: (p := env.pdd("sim-late"))
                   and condition(p, "Ready").get("reason") == "PoolNotFound" and p, env=env)
    assert condition(pdd, "Ready")["status"] == "False"
    assert env.deployment("sim-late-decode") is None
    # Events are posted from a queue, apart from the status write: the event may trail the condition a little.
    wait_for("PoolNotFound event", lambda: any(e["reason"] == "PoolNotFound" and e["type"] == "Warning"
                                               for e in env.events("sim-late")), env=env)

    env.apply(pool_manifest("pool-late", auth={"secretRef": {"name": "late-token"}}))
    wait_for("children once the pool exists", lambda: env.deployment("sim-late-decode"), env=env)
    wait_for("PoolNotFound cleared", lambda: condition(env.pdd("sim-late"), "Ready").get("reason") != "PoolNotFound",
             env=env)
    pool = wait_for("SecretNotFound", lambda: (p := env.pool("pool-late"))
                    and condition(p, "Ready").get("reason") == "SecretNotFound" and p, env=env)
    assert "late-token" in condition(pool, "Ready")["message"]
    env.cluster.kubectl("create", "secret", "generic", "-n", NS, "late-token", "--from-literal=token=abc")
    wait_for("SecretNotFound cleared", lambda: condition(env.pool("pool-late"), "Ready").get("reason")
             != "SecretNotFound", timeout=RESYNC * 10, env=env)


def test_a_child_the_apiserver_rejects_sets_a_condition_naming_the_field(env: Env) -> None:
    bad = pdd_manifest("sim-bad", "pool-a", decode={"replicas": 1, "template": {
        "spec": {"containers": [{"name": "engine", "ports": [{"name": "http", "containerPort": 70000}]}]}}})
    env.apply(bad)
    pdd = wait_for("ReconcileFailed", lambda: (p := env.pdd("sim-bad"))
                   and condition(p, "Ready").get("reason") == "ReconcileFailed" and p, env=env)
    message = condition(pdd, "Ready")["message"]
    assert "sim-bad-decode" in message and "containerPort" in message
    wait_for("a warning event", lambda: any(e["reason"] == "ReconcileFailed" and e["type"] == "Warning"
                                            for e in env.events("sim-bad")), env=env)
    env.cluster.kubectl("patch", "pdd", "-n", NS, "sim-bad", "--type=json",
                        "-p", '[{"op":"remove","path":"/spec/decode/template"}]')
    wait_for("recovery after the fix", lambda: env.deployment("sim-bad-decode")
             and condition(env.pdd("sim-bad"), "Ready").get("reason") != "ReconcileFailed", env=env)
    env.cluster.kubectl("delete", "pdd", "-n", NS, "sim-bad", "--wait=false")


def test_agents_may_only_label_their_own_node(env: Env) -> None:
    pods = env.get(f"/api/v1/namespaces/{NS}/pods?labelSelector=daybreak.dev/pool=pool-a,"
                   "app.kubernetes.io/component=agent") or {}
    pod = next(p for p in pods["items"] if p["spec"].get("nodeName") == "daybreak-node-0")
    token = env.cluster.kubectl("create", "token", "-n", NS, "pool-a-daybreak-agent", "--bound-object-kind=Pod",
                                f"--bound-object-name={pod['metadata']['name']}",
                                f"--bound-object-uid={pod['metadata']['uid']}").stdout.strip()
    with httpx.Client(base_url=env.cluster.server, verify=ssl.create_default_context(cafile=str(env.cluster.pki.ca_cert)), timeout=30,
                      headers={"Authorization": f"Bearer {token}"}) as agent:
        def patch_node(node: str, labels: dict[str, str]) -> httpx.Response:
            return agent.patch(f"/api/v1/nodes/{node}?dryRun=All", json={"metadata": {"labels": labels}},
                               headers={"Content-Type": "application/merge-patch+json"})

        own = patch_node("daybreak-node-0", {"daybreak.dev/rdma": "false"})
        assert own.status_code == 200, own.text
        other = patch_node("daybreak-node-1", {"daybreak.dev/rdma": "false"})
        assert other.status_code == 403 and "only change the node it runs on" in other.text
        foreign = patch_node("daybreak-node-0", {"team": "x"})
        assert foreign.status_code == 403 and "daybreak.dev/ labels" in foreign.text

        def kvnode(node: str) -> httpx.Response:
            body = {"apiVersion": "daybreak.dev/v1alpha1", "kind": "KVNode", "metadata": {"name": node},
                    "spec": {"nodeName": node}}
            return agent.post("/apis/daybreak.dev/v1alpha1/kvnodes?dryRun=All", json=body)

        assert kvnode("daybreak-node-0").status_code in (201, 409)
        assert kvnode("daybreak-node-1").status_code == 403


def test_leader_handover_on_kill(env: Env) -> None:
    leader_id = env.leader()
    leader = env.operator(leader_id)
    standby = next(o for o in env.operators if o is not leader)
    assert leader.metric("daybreak_operator_leader") == 1.0
    assert leader.metric("daybreak_operator_reconciles_total", result="success") > 0
    # The standby has not reconciled or written anything while the leader lived.
    assert standby.metric("daybreak_operator_leader") == 0.0
    assert standby.metric("daybreak_operator_reconciles_total") == 0.0
    assert standby.metric("daybreak_operator_children_applied_total") == 0.0

    killed_at = time.monotonic()
    leader.kill(signal.SIGKILL)
    new_id = wait_for("the standby to take the Lease", lambda: (h := env.leader()) != leader_id and h,
                      timeout=60, env=env)
    assert new_id.startswith(standby.identity + "_")
    print(f"lease hand-over after SIGKILL took {time.monotonic() - killed_at:.1f}s")
    decode = wait_for("decode", lambda: env.deployment("sim-a-decode"), env=env)
    env.cluster.kubectl("delete", "deployment", "-n", NS, "sim-a-decode", "--wait=false")
    wait_for("the new leader to restore decode", lambda: (d := env.deployment("sim-a-decode"))
             and d["metadata"]["uid"] != decode["metadata"]["uid"], env=env)
    print(f"first reconcile by the new leader {time.monotonic() - killed_at:.1f}s after the kill")
    assert standby.metric("daybreak_operator_leader") == 1.0
    assert standby.alive()


def test_router_disabled_removes_router_children(env: Env) -> None:
    env.cluster.kubectl("patch", "pdd", "-n", NS, "sim-a", "--type=merge", "-p", '{"spec":{"router":{"enabled":false}}}')
    wait_for("router Deployment gone", lambda: env.deployment("sim-a-router") is None, env=env)
    wait_for("router Service gone", lambda: env.get(f"/api/v1/namespaces/{NS}/services/sim-a") is None, env=env)


def test_deleting_the_pool_under_a_deployment_sets_a_condition(env: Env) -> None:
    env.cluster.kubectl("delete", "kvp", "-n", NS, "pool-a", "--wait=false")
    wait_for("PoolNotFound on sim-a", lambda: condition(env.pdd("sim-a"), "Ready").get("reason") == "PoolNotFound",
             env=env)
    wait_for("agent DaemonSet garbage-collected",
             lambda: env.get(f"/apis/apps/v1/namespaces/{NS}/daemonsets/pool-a-agent") is None, env=env)
    agent = {"kind": "ServiceAccount", "name": "pool-a-daybreak-agent", "namespace": NS}
    wait_for("agent unbound", lambda: agent not in ((env.get(
        "/apis/rbac.authorization.k8s.io/v1/clusterrolebindings/daybreak-agents") or {}).get("subjects") or []),
        env=env)
    assert any(o.alive() for o in env.operators)
    assert env.deployment("sim-a-decode") is not None  # left running, not torn down, while the pool is away


def test_deleting_the_deployment_garbage_collects_its_children(env: Env) -> None:
    env.cluster.kubectl("delete", "pdd", "-n", NS, "sim-late", "--wait=false")

    def gone() -> bool:
        left = env.get(f"/apis/apps/v1/namespaces/{NS}/deployments?labelSelector=daybreak.dev/deployment=sim-late")
        services = env.get(f"/api/v1/namespaces/{NS}/services?labelSelector=daybreak.dev/deployment=sim-late")
        return not (left or {}).get("items") and not (services or {}).get("items")

    wait_for("sim-late's children garbage-collected", gone, timeout=90, env=env)
    for op in env.operators:
        if op.alive():
            assert "Traceback" not in op.log()
