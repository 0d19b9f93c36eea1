"""The pool policy in the operator: builders refuse what the admin did not allow, and agents get least privilege."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from daybreak.api.kvpool import KVPool
from daybreak.api.pddeployment import PDDeployment
from daybreak.operator import deployment as pdd_mod
from daybreak.operator import pool as pool_mod
from daybreak.operator.pool_policy import (
    PolicyError,
    PoolPolicy,
    deployment_violations,
    engine_pod_violations,
    pool_violations,
)
from daybreak.operator.settings import OperatorSettings
from daybreak.pool.engine_secret import credential_secret_name
from daybreak.testing.escalations import ESCALATIONS, Escalation

ROOT = Path(__file__).resolve().parents[2]
IMAGE = "example.test/daybreak:1"

# The tenant of issue 12: any image, host /etc as its SSD tier, and a toleration of every taint.
ATTACK = {"agent": {"image": "evil.example/rootkit:1"},
          "tiers": {"dram": {"bytesPerNode": "1Gi"}, "ssd": {"path": "/etc", "bytesPerNode": "1Gi"}},
          "tolerations": [{"operator": "Exists"}]}


def _pool(**spec: Any) -> KVPool:
    body = yaml.safe_load((ROOT / "examples" / "kvpool-minimal.yaml").read_text())
    body["metadata"].update({"namespace": "tenant", "uid": "u1", "generation": 1})
    body["spec"].update(spec)
    return KVPool.from_body(body)


def _daemonset(pool: KVPool, policy: PoolPolicy | None = None) -> dict[str, Any]:
    out = pool_mod.build(pool, image=IMAGE, policy=policy)
    return next(m for m in out.applied if m["kind"] == "DaemonSet")


def test_the_tenant_attack_is_refused_naming_every_field() -> None:
    with pytest.raises(PolicyError) as err:
        pool_mod.build(_pool(**ATTACK), image=IMAGE)
    fields = [v.field for v in err.value.violations]
    assert fields == ["spec.agent.image", "spec.tiers.ssd.path", "spec.tolerations[0].key"]
    assert "poolPolicy.allowedSSDRoots" in str(err.value) and "'/etc'" in str(err.value)


@pytest.mark.parametrize(("path", "allowed"), [
    ("/var/lib/daybreak", True), ("/var/lib/daybreak/kv", True), ("/mnt/nvme0/daybreak", True),
    ("/etc", False), ("/var/lib/daybreakx", False), ("/var/lib/daybreak/../../etc", False),
    ("/mnt/./x", False), ("/mnt//x", False), ("/", False), ("/var/lib", False),
])
def test_ssd_paths_must_lie_under_an_allowed_root(path: str, allowed: bool) -> None:
    assert PoolPolicy().ssd_path_allowed(path) is allowed
    ssd = {"path": path, "bytesPerNode": "1Gi"}
    violations = pool_violations(_pool(tiers={"ssd": ssd}), PoolPolicy())
    assert (violations == []) is allowed


def test_images_tolerations_and_roots_follow_the_admins_values() -> None:
    policy = PoolPolicy.from_data({"allowedAgentImages": "registry.corp/daybreak/, other.io/agent:2",
                                   "allowedTolerationKeys": "*", "allowedSSDRoots": "/data/",
                                   "agentPriorityClassName": "system-node-critical"})
    assert policy.allowed_ssd_roots == ("/data",)
    assert policy.agent_image_allowed("registry.corp/daybreak/agent:3")
    assert policy.agent_image_allowed("other.io/agent:2") and not policy.agent_image_allowed("other.io/agent:3")
    pool = _pool(agent={"image": "registry.corp/daybreak/agent:3"}, tolerations=[{"operator": "Exists"}],
                 tiers={"ssd": {"path": "/data/kv", "bytesPerNode": "1Gi"}})
    ds = _daemonset(pool, policy)
    pod = ds["spec"]["template"]["spec"]
    assert pod["containers"][0]["image"] == "registry.corp/daybreak/agent:3"
    assert pod["priorityClassName"] == "system-node-critical"
    assert pod_violations_free(pool, policy)
    with pytest.raises(ValueError, match="other than '/'"):
        PoolPolicy.from_data({"allowedSSDRoots": "/"})


def pod_violations_free(pool: KVPool, policy: PoolPolicy) -> bool:
    return pool_violations(pool, policy) == []


def test_a_dram_only_tcp_pool_runs_as_non_root_with_no_capabilities() -> None:
    ds = _daemonset(_pool(transport={"preference": ["shm", "tcp"]}))
    pod = ds["spec"]["template"]["spec"]
    group = PoolPolicy().pool_group("u1")
    assert 200000 <= group <= 299999
    assert pod["securityContext"] == {"runAsUser": 65532, "runAsGroup": group, "runAsNonRoot": True,
                                      "seccompProfile": {"type": "RuntimeDefault"}}
    (agent,) = pod["containers"]
    assert agent["securityContext"] == {"privileged": False, "allowPrivilegeEscalation": False,
                                        "readOnlyRootFilesystem": True, "capabilities": {"add": [], "drop": ["ALL"]}}
    host = {v["hostPath"]["path"] for v in pod["volumes"] if "hostPath" in v}
    assert host == {"/sys", "/dev/shm"}
    assert "priorityClassName" not in pod and "initContainers" not in pod


def test_an_ssd_tier_is_handed_to_the_agent_user_by_a_chown_only_init_container() -> None:
    ds = _daemonset(_pool(transport={"preference": ["tcp"]},
                          tiers={"ssd": {"path": "/var/lib/daybreak/kv", "bytesPerNode": "1Gi"}}))
    pod = ds["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    (init,) = pod["initContainers"]
    assert init["command"] == ["chown", "-R", "-h", f"65532:{PoolPolicy().pool_group('u1')}", "/var/lib/daybreak/kv"]
    assert init["securityContext"]["capabilities"] == {"add": ["CHOWN", "DAC_READ_SEARCH"], "drop": ["ALL"]}
    assert [m["mountPath"] for m in init["volumeMounts"]] == ["/var/lib/daybreak/kv"]


def test_rdma_needs_root_with_ipc_lock_only() -> None:
    ds = _daemonset(_pool(transport={"preference": ["rdma", "tcp"]}))
    pod = ds["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsUser"] == 0
    assert pod["containers"][0]["securityContext"]["capabilities"] == {"add": ["IPC_LOCK"], "drop": ["ALL"]}


def test_engine_templates_may_not_reach_the_host() -> None:
    body = yaml.safe_load((ROOT / "examples" / "pddeployment-sim.yaml").read_text())
    body["metadata"].update({"namespace": "tenant", "uid": "u2", "generation": 1})
    body["spec"]["decode"]["template"] = {"spec": {
        "hostPID": True, "volumes": [{"name": "root", "hostPath": {"path": "/"}}],
        "containers": [{"name": "engine", "securityContext": {"privileged": True,
                                                               "capabilities": {"add": ["SYS_ADMIN"]}}}]}}
    with pytest.raises(PolicyError) as err:
        pdd_mod.build(PDDeployment.from_body(body), _pool(), image=IMAGE)
    assert [v.field for v in err.value.violations] == [
        "spec.decode.template.spec.hostPID", "spec.decode.template.spec.volumes[0].hostPath.path",
        "spec.decode.template.spec.containers[0].securityContext.privileged",
        "spec.decode.template.spec.containers[0].securityContext.capabilities.add"]


def test_operator_reads_the_policy_from_the_mounted_configmap(tmp_path: Path) -> None:
    (tmp_path / "allowedSSDRoots").write_text("/srv/kv")
    (tmp_path / "allowedTolerationKeys").write_text("")
    settings = OperatorSettings.load(overrides={"policy_dir": str(tmp_path)}, environ={})
    assert settings.pool_policy.allowed_ssd_roots == ("/srv/kv",)
    assert settings.pool_policy.allowed_toleration_keys == ()
    assert settings.pool_policy.allowed_agent_images == ()  # absent key: the default
    assert OperatorSettings.load(environ={}).pool_policy == PoolPolicy()
    with pytest.raises(ValueError, match="does not exist"):
        OperatorSettings.load(overrides={"policy_dir": str(tmp_path / "missing")}, environ={})
    many = OperatorSettings.load(overrides={"namespace": "a, b"}, environ={})
    assert many.namespaces == ("a", "b")


def test_a_default_pool_runs_its_agents_non_root_without_rdma() -> None:
    """Issue 22 finding 5: rdma is opt-in, so the example pool (no transport list) gets no root, no IPC_LOCK
    and no /dev/infiniband."""
    pod = _daemonset(_pool())["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsUser"] == 65532 and pod["securityContext"]["runAsNonRoot"] is True
    (agent,) = pod["containers"]
    assert agent["securityContext"]["capabilities"] == {"add": [], "drop": ["ALL"]}
    assert "/dev/infiniband" not in {v.get("hostPath", {}).get("path") for v in pod["volumes"]}
    assert "/dev/infiniband" not in {m["mountPath"] for m in agent["volumeMounts"]}


def test_each_pool_has_its_own_ports_inside_the_admins_range() -> None:
    """Issue 22 finding 5: no host port shared by every pool (metrics follow the store port), and the store
    port is limited to poolPolicy.agentPortRange."""
    ds = _daemonset(_pool(agent={"port": 7410}))
    (agent,) = ds["spec"]["template"]["spec"]["containers"]
    assert {p["name"]: p["containerPort"] for p in agent["ports"]} == {"store": 7410, "metrics": 7411}
    other = _daemonset(_pool(agent={"port": 7412}))
    assert {p["containerPort"] for p in agent["ports"]}.isdisjoint(
        p["containerPort"] for p in other["spec"]["template"]["spec"]["containers"][0]["ports"])
    for port in (10250, 22, 7599):
        with pytest.raises(PolicyError) as err:
            pool_mod.build(_pool(agent={"port": port}), image=IMAGE)
        assert [v.field for v in err.value.violations] == ["spec.agent.port"]
        assert "poolPolicy.agentPortRange" in str(err.value)
    wide = PoolPolicy.from_data({"agentPortRange": "9000-9100"})
    assert _daemonset(_pool(agent={"port": 9000}), wide) and wide.to_data()["agentPortRange"] == "9000-9100"


def _pdd_body() -> dict[str, Any]:
    body = yaml.safe_load((ROOT / "examples" / "pddeployment-sim.yaml").read_text())
    body["metadata"].update({"namespace": "tenant", "uid": "u2", "generation": 1})
    return dict(body)


@pytest.mark.parametrize("case", ESCALATIONS, ids=lambda c: c.name)
def test_engine_escalations_are_refused_by_the_operator_naming_the_field(case: Escalation) -> None:
    """Issue 22 finding 4, the operator's own check: the PDDeployment is refused before anything is built."""
    pdd = PDDeployment.from_body(case.pdd(_pdd_body()))
    with pytest.raises(PolicyError) as err:
        pdd_mod.build(pdd, _pool(), image=IMAGE)
    fields = [v.field for v in err.value.violations]
    assert fields and all(f.startswith(case.admission_field()) for f in fields), fields
    assert deployment_violations(pdd, PoolPolicy())


@pytest.mark.parametrize("case", ESCALATIONS, ids=lambda c: c.name)
def test_engine_escalations_written_into_a_built_workload_are_refused(case: Escalation) -> None:
    """The same escalations in the Deployment the operator would write (the write policy's side in Python)."""
    pdd = PDDeployment.from_body(_pdd_body())
    built = pdd_mod.build(pdd, _pool(), image=IMAGE)
    deployment = next(m for _, m in built.applied if m["kind"] == "Deployment")
    credential = credential_secret_name(pdd.metadata.name or "", pdd.spec.kv_namespace())
    assert engine_pod_violations(deployment["spec"]["template"], where="spec.template", policy=PoolPolicy(),
                                 credential=credential) == []
    bad = case.workload(deployment)["spec"]["template"]
    fields = [v.field for v in engine_pod_violations(bad, where="spec.template", policy=PoolPolicy(),
                                                     credential=credential)]
    assert fields and all(f.startswith(case.workload_field()) for f in fields), fields


def test_engines_run_as_their_pools_id_non_root_and_keep_the_operators_variables() -> None:
    pool = _pool()
    group = PoolPolicy().pool_group("u1")
    body = _pdd_body()
    body["spec"]["decode"]["template"] = {"spec": {
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists"}],
        "volumes": [{"name": "cache", "emptyDir": {}}, {"name": "hf", "persistentVolumeClaim": {"claimName": "hf"}}],
        "containers": [{"name": "engine", "securityContext": {"capabilities": {"add": ["IPC_LOCK"]}}}]}}
    built = pdd_mod.build(PDDeployment.from_body(body), pool, image=IMAGE)
    for _, m in built.applied:
        if m["kind"] == "Deployment":
            pod = m["spec"]["template"]["spec"]
            assert pod["securityContext"] == {"runAsNonRoot": True, "runAsUser": group, "runAsGroup": group,
                                              "seccompProfile": {"type": "RuntimeDefault"}}
            assert all(c["securityContext"]["allowPrivilegeEscalation"] is False for c in pod["containers"])
    # Another pool gets another id: its engines cannot open this pool's 0660 segments.
    assert PoolPolicy().pool_group("u-other") != group
    ds = _daemonset(pool)
    assert ds["spec"]["template"]["spec"]["securityContext"]["runAsGroup"] == group
    config = yaml.safe_load(next(m for m in pool_mod.build(pool, image=IMAGE).applied
                                 if m["kind"] == "ConfigMap")["data"]["agent.yaml"])
    assert config["shm_group_access"] is True and config["metrics_port"] == 7401


def test_segments_are_shared_with_the_agents_group_only_when_told() -> None:
    """The agent's DRAM segments: 0660 for its primary group (the pool's id under the operator), never for
    others; a segment of another group with group access is not adopted."""
    import os
    import uuid

    from daybreak.pool import shm

    name = f"daybreak-test-{uuid.uuid4().hex[:8]}"
    try:
        shm.share_with_group(True)
        seg = shm.ShmSegment.create(name, 4096)
        assert os.stat(shm.ShmSegment.path_of(name)).st_mode & 0o777 == 0o660
        seg.close()
        again = shm.ShmSegment.create(name, 4096, exist_ok=True)  # re-adopted: group access is its own group's
        again.close()
        shm.share_with_group(False)
        private = shm.ShmSegment.create(name + "-p", 4096)
        assert os.stat(shm.ShmSegment.path_of(name + "-p")).st_mode & 0o777 == 0o600
        private.close()
        os.chmod(shm.ShmSegment.path_of(name), 0o666)
        with pytest.raises(shm.NotOwned):
            shm.ShmSegment.create(name, 4096, exist_ok=True)
    finally:
        shm.share_with_group(False)
        for n in (name, name + "-p"):
            shm.ShmSegment.path_of(n).unlink(missing_ok=True)
