"""The operator's serving pod templates: the commands, flags and env the sim engine and router need, their rights."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

import yaml

from daybreak.api.kvpool import KVPool
from daybreak.api.pddeployment import PDDeployment, Role
from daybreak.devenv import tools
from daybreak.operator import deployment as pdd_mod
from daybreak.operator import pool as pool_mod
from daybreak.pool.engine_secret import credential_secret_name

ROOT = Path(__file__).resolve().parents[2]
IMAGE = "example.test/daybreak:1"


def _load(name: str) -> dict[str, Any]:
    body = yaml.safe_load((ROOT / "examples" / name).read_text())
    body["metadata"].update({"namespace": "ns1", "uid": "uid-1", "generation": 3})
    return dict(body)


def _pool(**spec: Any) -> KVPool:
    body = _load("kvpool-minimal.yaml")
    body["spec"].update(spec)
    return KVPool.from_body(body)


def _pdd() -> PDDeployment:
    return PDDeployment.from_body(_load("pddeployment-sim.yaml"))


def _workload(out: pdd_mod.DeploymentChildren, role: Role) -> dict[str, Any]:
    return next(m for r, m in out.applied if r == role and m["kind"] == "Deployment")


def _container(workload: dict[str, Any]) -> dict[str, Any]:
    return dict(workload["spec"]["template"]["spec"]["containers"][0])


def _refs_defined_before_use(container: dict[str, Any]) -> list[str]:
    """Every $(VAR) in command, args and env values names a variable defined earlier in env (kubelet rule)."""
    defined: set[str] = set()
    bad = []
    for item in container.get("env") or []:
        for ref in re.findall(r"\$\(([^)]+)\)", str(item.get("value") or "")):
            if ref not in defined:
                bad.append(f"env {item['name']} uses $({ref})")
        defined.add(item["name"])
    for word in [*(container.get("command") or []), *(container.get("args") or [])]:
        bad += [f"command uses $({ref})" for ref in re.findall(r"\$\(([^)]+)\)", word) if ref not in defined]
    return bad


def test_sim_engines_find_the_pool_through_the_api_and_are_ready_only_when_they_serve() -> None:
    pdd, pool = _pdd(), _pool()
    out = pdd_mod.build(pdd, pool, image=IMAGE)
    for role in (Role.PREFILL, Role.DECODE):
        workload = _workload(out, role)
        container = _container(workload)
        command = container["command"]
        assert command[:4] == ["daybreak", "sim-engine", "--role", role.value]
        flags = dict(zip(command[4::2], command[5::2], strict=True))
        assert flags == {"--host": "$(POD_IP)", "--port": "8000", "--pool-ref": "ns1/kv-minimal"}
        env = {e["name"]: e for e in container["env"]}
        assert env["POD_IP"]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
        assert {"POD_NAME", "POD_NAMESPACE", "NODE_NAME"} <= env.keys()
        # The agent-minted credential of this kvNamespace, never the pool secret; the pod waits for it.
        assert env["DAYBREAK_POOL_TOKEN"]["valueFrom"] == {"secretKeyRef": {
            "name": credential_secret_name("sim-llama", pdd.spec.kv_namespace()), "key": "token", "optional": False}}
        assert env["DAYBREAK_KV_NAMESPACE"]["value"] == pdd.spec.kv_namespace()
        assert json.loads(env["DAYBREAK_KV_LAYOUT"]["value"]) == pdd.spec.model.kv_layout.to_dict()
        assert env["DAYBREAK_ROLE"]["value"] == role.value
        assert container["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
        assert workload["spec"]["template"]["spec"]["serviceAccountName"] == "sim-llama-serving"
        assert _refs_defined_before_use(container) == []


def test_the_router_discovers_engines_from_endpointslices_and_takes_the_namespace_credential() -> None:
    pdd = _pdd()
    pool = _pool(auth={"secretRef": {"name": "my-token"}})
    router = _workload(pdd_mod.build(pdd, pool, image=IMAGE), Role.ROUTER)
    container = _container(router)
    command = container["command"]
    assert command[:2] == ["daybreak", "router"]
    flags = dict(zip(command[2::2], command[3::2], strict=True))
    assert flags == {"--host": "$(POD_IP)", "--port": "8000", "--namespace": "ns1",
                     "--prefill-service": "sim-llama-prefill", "--decode-service": "sim-llama-decode",
                     "--pool-ref": "ns1/kv-minimal", "--drain-seconds": "30",
                     "--drain-quiet-seconds": "15"}
    # It rolls surge first whatever updateStrategy says, and its grace period covers its drain.
    assert router["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}
    assert router["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > 30
    env = {e["name"]: e for e in container["env"]}
    # Even with the pool's own secretRef, the router gets the namespace credential, not the pool secret.
    assert env["DAYBREAK_POOL_TOKEN"]["valueFrom"] == {"secretKeyRef": {
        "name": credential_secret_name("sim-llama", pdd.spec.kv_namespace()), "key": "token", "optional": False}}
    # The kvNamespace comes from the engine pods' label per request.
    assert "DAYBREAK_KV_NAMESPACE" not in env
    assert json.loads(env["DAYBREAK_KV_LAYOUT"]["value"]) == pdd.spec.model.kv_layout.to_dict()
    # No DNS on the data path: nothing names a Service host.
    assert not [e for e in env.values() if ".svc" in str(e.get("value") or "")]
    assert container["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert router["spec"]["template"]["spec"]["serviceAccountName"] == "sim-llama-serving"
    assert _refs_defined_before_use(container) == []
    # router.prefillConcurrency and decodePrefill reach the router as its flags.
    bounded = PDDeployment.from_body(_load("pddeployment-sim.yaml") | {"spec": {
        **_load("pddeployment-sim.yaml")["spec"], "router": {"prefillConcurrency": 3, "decodePrefill": 2}}})
    command = _container(_workload(pdd_mod.build(bounded, pool, image=IMAGE), Role.ROUTER))["command"]
    assert command[-4:] == ["--prefill-concurrency", "3", "--decode-prefill", "2"]
    # roomOrder deadline passes the TTFT target the planner keeps (autoscaling.ttftSeconds).
    spec = _load("pddeployment-sim.yaml")["spec"]
    ordered = PDDeployment.from_body(_load("pddeployment-sim.yaml") | {"spec": {
        **spec, "router": {"prefillConcurrency": 1, "roomOrder": "deadline"},
        "autoscaling": {**spec.get("autoscaling", {}), "ttftSeconds": 2.5}}})
    command = _container(_workload(pdd_mod.build(ordered, pool, image=IMAGE), Role.ROUTER))["command"]
    assert command[-4:] == ["--prefill-concurrency", "1", "--ttft-target", "2.5"]


def test_serving_pods_may_read_their_pool_endpointslices_and_pods_and_nothing_else() -> None:
    out = pdd_mod.build(_pdd(), _pool(), image=IMAGE)
    by_kind = {m["kind"]: m for m in out.access}
    assert [m["kind"] for m in out.access] == ["ServiceAccount", "Role", "RoleBinding"]
    assert {m["metadata"]["name"] for m in out.access} == {"sim-llama-serving"}
    assert by_kind["Role"]["rules"] == [
        {"apiGroups": ["daybreak.dev"], "resources": ["kvpools"], "resourceNames": ["kv-minimal"], "verbs": ["get"]},
        {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["list", "watch"]},
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["list"]},
    ]
    assert by_kind["RoleBinding"]["subjects"] == [{"kind": "ServiceAccount", "name": "sim-llama-serving",
                                                   "namespace": "ns1"}]
    labels = pdd_mod.access_labels(_pdd())
    assert labels["daybreak.dev/deployment"] == "sim-llama" and "daybreak.dev/role" not in labels


def test_the_charts_operator_role_holds_every_right_it_grants_serving_pods() -> None:
    """RBAC refuses a Role granting what its creator lacks: the chart's ClusterRole must cover the serving Role."""
    text = subprocess.run([str(tools.find("helm")), "template", "t", str(ROOT / "charts" / "daybreak"),
                           "--kube-version", "1.37.2", "--show-only", "templates/rbac.yaml"],
                          capture_output=True, text=True, check=True, timeout=60).stdout
    operator_role = next(d for d in yaml.safe_load_all(text) if d and d["kind"] == "ClusterRole")
    held = operator_role["rules"]
    granted = next(m for m in pdd_mod.build(_pdd(), _pool(), image=IMAGE).access if m["kind"] == "Role")["rules"]
    for rule in granted:
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                for verb in rule["verbs"]:
                    assert any(group in h["apiGroups"] and resource in h["resources"] and verb in h["verbs"]
                               and not h.get("resourceNames") for h in held), (group, resource, verb)


def test_agents_listen_on_their_own_address_so_fake_nodes_can_share_a_host() -> None:
    pool = _pool()
    ds = next(m for m in pool_mod.build(pool, image=IMAGE).applied if m["kind"] == "DaemonSet")
    container = ds["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e for e in container["env"]}
    assert env["DAYBREAK_LISTEN"]["value"] == "$(DAYBREAK_POD_IP):7400"
    assert env["DAYBREAK_ADVERTISE"]["value"] == "$(DAYBREAK_POD_IP):7400"
    assert _refs_defined_before_use(container) == []


def test_a_model_revision_upgrade_changes_the_router_only_through_its_credential() -> None:
    """A new kvNamespace changes the engine templates; the router's template differs only in which namespace
    credential it mounts (the router reads each request's namespace from the engine pods' labels)."""
    pool = _pool()
    pdd = _pdd()
    before = pdd_mod.build(pdd, pool, image=IMAGE)
    upgraded = pdd.model_copy(deep=True)
    upgraded.spec.model.revision = "v2-upgraded"
    after = pdd_mod.build(upgraded, pool, image=IMAGE)
    assert upgraded.spec.kv_namespace() != pdd.spec.kv_namespace()
    assert _workload(after, Role.DECODE)["spec"]["template"] != _workload(before, Role.DECODE)["spec"]["template"]
    old_router = _workload(before, Role.ROUTER)["spec"]["template"]
    new_router = _workload(after, Role.ROUTER)["spec"]["template"]

    def token_ref(template: dict) -> str:
        env = {e["name"]: e for e in template["spec"]["containers"][0]["env"]}
        return str(env["DAYBREAK_POOL_TOKEN"]["valueFrom"]["secretKeyRef"]["name"])

    assert token_ref(new_router) == credential_secret_name("sim-llama", upgraded.spec.kv_namespace())
    json_old = json.dumps(old_router, sort_keys=True).replace(token_ref(old_router), "CRED")
    json_new = json.dumps(new_router, sort_keys=True).replace(token_ref(new_router), "CRED")
    assert json_old == json_new
