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
from daybreak.operator.policy import PolicyError, PoolPolicy, pool_violations
from daybreak.operator.settings import OperatorSettings

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
    out = pool_mod.build(pool, image=IMAGE, metrics_port=9401, policy=policy)
    return next(m for m in out.applied if m["kind"] == "DaemonSet")


def test_the_tenant_attack_is_refused_naming_every_field() -> None:
    with pytest.raises(PolicyError) as err:
        pool_mod.build(_pool(**ATTACK), image=IMAGE, metrics_port=9401)
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
    assert pod["securityContext"] == {"runAsUser": 65532, "runAsGroup": 65532, "runAsNonRoot": True,
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
    assert init["command"] == ["chown", "-R", "-h", "65532:65532", "/var/lib/daybreak/kv"]
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
        "spec.decode.template.spec.hostPID", "spec.decode.template.spec.volumes[1].hostPath.path",
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
