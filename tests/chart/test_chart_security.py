"""The chart's security controls against a real API server: pool policy at admission, the operator's RBAC
(`kubectl auth can-i`) and the admission policy on the operator's own writes."""

from __future__ import annotations

import copy
import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from chartlib import ROOT

from daybreak.api.kvpool import KVPool
from daybreak.api.pddeployment import PDDeployment
from daybreak.devenv.cluster import LocalCluster
from daybreak.operator import deployment as pdd_mod
from daybreak.operator import pool as pool_mod
from daybreak.testing.escalations import ESCALATIONS, Escalation

RELEASE, RELEASE_NS = "sec", "daybreak-sec"
POOL_NS, OTHER_NS = "sec-pools", "sec-other"
OPERATOR = f"system:serviceaccount:{RELEASE_NS}:{RELEASE}-daybreak-operator"
IMAGE = "ghcr.io/daybreak-ai/daybreak:0.1.0"  # the chart's image at appVersion: what the operator is given
TENANT = "tenant-alice"
TENANT_SA = f"system:serviceaccount:{POOL_NS}:tenant"  # issue 22: a tenant ServiceAccount, same Role

TENANT_RBAC = f"""
apiVersion: rbac.authorization.k8s.io/v1
kind: Role
metadata: {{name: kvpool-editor, namespace: {POOL_NS}}}
rules:
  - apiGroups: [daybreak.dev]
    resources: [kvpools, pddeployments]
    verbs: [get, list, create, update, patch]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: RoleBinding
metadata: {{name: kvpool-editor, namespace: {POOL_NS}}}
roleRef: {{apiGroup: rbac.authorization.k8s.io, kind: Role, name: kvpool-editor}}
subjects: [{{apiGroup: rbac.authorization.k8s.io, kind: User, name: {TENANT}}},
           {{kind: ServiceAccount, name: tenant, namespace: {POOL_NS}}}]
"""

# Issue 12 finding 1, as the tenant sent it.
ATTACK: dict[str, Any] = {"agent": {"image": "evil.example/rootkit:1"},
                          "tiers": {"dram": {"bytesPerNode": "1Gi"},
                                    "ssd": {"path": "/etc", "bytesPerNode": "1Gi"}},
                          "tolerations": [{"operator": "Exists"}]}


def _pool(name: str, **spec: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"apiVersion": "daybreak.dev/v1alpha1", "kind": "KVPool",
                            "metadata": {"name": name, "namespace": POOL_NS},
                            "spec": {"tiers": {"dram": {"bytesPerNode": "1Gi"}}}}
    body["spec"].update(spec)
    return body


def _pdd(name: str, decode_template: dict[str, Any]) -> dict[str, Any]:
    body = yaml.safe_load((ROOT / "examples" / "pddeployment-sim.yaml").read_text())
    body["metadata"] = {"name": name, "namespace": POOL_NS}
    body["spec"]["decode"]["template"] = decode_template
    return dict(body)


@pytest.fixture(scope="module")
def installed(kube: LocalCluster, render_text: Callable[..., str]) -> Iterator[str]:
    kube.kubectl("apply", "-f", str(ROOT / "crds"))
    for ns in (RELEASE_NS, POOL_NS, OTHER_NS):
        kube.kubectl("create", "namespace", ns, check=False)
    text = render_text("--set", f"operator.watchNamespaces={{{POOL_NS}}}", release=RELEASE, namespace=RELEASE_NS)
    kube.kubectl("apply", "-f", "-", stdin=text)
    kube.kubectl("apply", "-f", "-", stdin=TENANT_RBAC)
    # Admission policies take effect once the API server's informers have them and their parameter.
    deadline = time.monotonic() + 60
    probes = {"daybreak-pool-policy": _pool("probe", tiers={"ssd": {"path": "/etc", "bytesPerNode": "1Gi"}}),
              "daybreak-deployment-policy": _pdd("probe", {"spec": {"hostPID": True}})}
    for policy, probe in probes.items():
        while True:
            out = kube.kubectl("create", "--dry-run=server", "-f", "-", stdin=json.dumps(probe), check=False)
            if policy in out.stderr:
                break
            assert time.monotonic() < deadline, f"{policy} never took effect: {out.stdout}{out.stderr}"
            time.sleep(0.5)
    try:
        yield text
    finally:
        kube.kubectl("delete", "-f", "-", "--ignore-not-found", "--wait=false", stdin=TENANT_RBAC, check=False)
        kube.kubectl("delete", "-f", "-", "--ignore-not-found", "--wait=false", stdin=text, check=False)
        for ns in (POOL_NS, OTHER_NS):
            kube.kubectl("delete", "namespace", ns, "--wait=false", check=False)


def _as_tenant(kube: LocalCluster, *args: str, stdin: str | None = None, who: str = TENANT) -> Any:
    return kube.kubectl(f"--as={who}", "-n", POOL_NS, *args, stdin=stdin, check=False)


@pytest.mark.parametrize(("name", "spec", "field"), [
    ("image", {"agent": {"image": "evil.example/rootkit:1"}}, "spec.agent.image"),
    ("etc", {"tiers": {"dram": {"bytesPerNode": "1Gi"}, "ssd": {"path": "/etc", "bytesPerNode": "1Gi"}}},
     "spec.tiers.ssd.path"),
    ("dotdot", {"tiers": {"ssd": {"path": "/var/lib/daybreak/../../../etc", "bytesPerNode": "1Gi"}}},
     "spec.tiers.ssd.path"),
    ("everywhere", {"tolerations": [{"operator": "Exists"}]}, "spec.tolerations"),
    ("control-plane", {"tolerations": [{"key": "node-role.kubernetes.io/control-plane", "operator": "Exists"}]},
     "spec.tolerations"),
    ("attack", ATTACK, "spec.agent.image"),
    ("kubelet-port", {"agent": {"port": 10250}}, "spec.agent.port"),
    ("range-end", {"agent": {"port": 7599}}, "spec.agent.port"),
])
def test_tenant_kvpool_is_refused_at_admission_naming_the_field(kube: LocalCluster, installed: str, name: str,
                                                                spec: dict[str, Any], field: str) -> None:
    out = _as_tenant(kube, "create", "-f", "-", stdin=json.dumps(_pool(f"bad-{name}", **spec)))
    assert out.returncode != 0, f"admitted: {out.stdout}"
    assert "daybreak-pool-policy" in out.stderr and f"{field}:" in out.stderr, out.stderr
    assert _as_tenant(kube, "get", "kvp", f"bad-{name}").returncode != 0  # nothing was stored


def test_tenant_kvpool_within_the_policy_is_admitted_and_cannot_be_changed_to_escape(kube: LocalCluster,
                                                                                  installed: str) -> None:
    good = _pool("good", tolerations=[{"key": "daybreak.dev/dedicated", "operator": "Exists"}],
                 tiers={"dram": {"bytesPerNode": "1Gi"}, "ssd": {"path": "/mnt/nvme0/kv", "bytesPerNode": "1Gi"}})
    out = _as_tenant(kube, "create", "-f", "-", stdin=json.dumps(good))
    assert out.returncode == 0, out.stderr
    patch = json.dumps({"spec": {"tiers": {"ssd": {"path": "/root"}}}})
    out = _as_tenant(kube, "patch", "kvp", "good", "--type=merge", "-p", patch)
    assert out.returncode != 0 and "spec.tiers.ssd.path: host path '/root'" in out.stderr, out.stderr


@pytest.mark.parametrize(("name", "spec", "field"), [
    ("hostpid", {"hostPID": True}, "spec.decode.template.spec:"),
    ("root", {"volumes": [{"name": "root", "hostPath": {"path": "/"}}]}, "spec.decode.template.spec.volumes:"),
    ("privileged", {"containers": [{"name": "engine", "securityContext": {"privileged": True}}]},
     "spec.decode.template.spec.containers:"),
    ("sysadmin", {"containers": [{"name": "engine", "securityContext": {"capabilities": {"add": ["SYS_ADMIN"]}}}]},
     "spec.decode.template.spec.containers:"),
    ("agent-sa", {"serviceAccountName": "kv-minimal-daybreak-agent"},
     "spec.decode.template.spec.serviceAccountName:"),
])
def test_tenant_pddeployment_template_reaching_the_host_is_refused_at_admission(
        kube: LocalCluster, installed: str, name: str, spec: dict[str, Any], field: str) -> None:
    out = _as_tenant(kube, "create", "-f", "-", stdin=json.dumps(_pdd(f"bad-{name}", {"spec": spec})))
    assert out.returncode != 0, f"admitted: {out.stdout}"
    assert "daybreak-deployment-policy" in out.stderr and field in out.stderr, out.stderr


@pytest.mark.parametrize("case", ESCALATIONS, ids=lambda c: c.name)
def test_tenant_service_account_pddeployment_escalations_are_refused_at_admission(
        kube: LocalCluster, installed: str, case: Escalation) -> None:
    """Issue 22 finding 4: a ServiceAccount that may only create KVPools and PDDeployments gets none of
    these engine pods; the API server refuses the PDDeployment and names the field."""
    body = case.pdd(_pdd(f"esc-{case.name}", {}))
    if not case.template:
        del body["spec"]["decode"]["template"]
    out = _as_tenant(kube, "create", "-f", "-", stdin=json.dumps(body), who=TENANT_SA)
    assert out.returncode != 0, f"admitted: {out.stdout}"
    assert "daybreak-deployment-policy" in out.stderr and f"{case.admission_field()}" in out.stderr, out.stderr
    assert _as_tenant(kube, "get", "pdd", f"esc-{case.name}").returncode != 0  # nothing was stored


def test_tenant_pddeployment_with_a_harmless_template_is_admitted(kube: LocalCluster, installed: str) -> None:
    template = {"spec": {"tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists"}],
                         "volumes": [{"name": "shm", "hostPath": {"path": "/dev/shm"}},
                                     {"name": "cache", "emptyDir": {}}],
                         "containers": [{"name": "engine", "securityContext": {"capabilities": {"add": ["IPC_LOCK"]}}}]}}
    out = _as_tenant(kube, "create", "--dry-run=server", "-f", "-", stdin=json.dumps(_pdd("fine", template)))
    assert out.returncode == 0, out.stderr


# -- the operator's RBAC ----------------------------------------------------------------------------------
# (verb, resource, namespace or None for cluster scope, expected). "resource/name" checks one object.
NEEDED = [
    ("watch", "kvpools.daybreak.dev", POOL_NS), ("get", "kvpools.daybreak.dev", POOL_NS),
    ("patch", "kvpools.daybreak.dev/status", POOL_NS), ("patch", "pddeployments.daybreak.dev/status", POOL_NS),
    ("create", "daemonsets.apps", POOL_NS), ("patch", "daemonsets.apps", POOL_NS),
    ("create", "deployments.apps", POOL_NS), ("delete", "deployments.apps", POOL_NS),
    ("create", "secrets", POOL_NS), ("create", "serviceaccounts", POOL_NS), ("patch", "configmaps", POOL_NS),
    ("delete", "services", POOL_NS), ("list", "pods", POOL_NS), ("create", "events", POOL_NS),
    ("create", "roles.rbac.authorization.k8s.io", POOL_NS), ("patch", "rolebindings.rbac.authorization.k8s.io", POOL_NS),
    ("list", "kvnodes.daybreak.dev", None),
    ("update", "clusterrolebindings.rbac.authorization.k8s.io/daybreak-agents", None),
    ("bind", "clusterroles.rbac.authorization.k8s.io/daybreak-agent", None),
    ("update", "leases.coordination.k8s.io/daybreak-operator", RELEASE_NS),
    ("create", "leases.coordination.k8s.io", RELEASE_NS),
]
FORBIDDEN = [
    ("get", "secrets/bootstrap-token", "kube-system"), ("list", "secrets", "kube-system"),
    ("get", "secrets", POOL_NS), ("list", "secrets", POOL_NS), ("watch", "secrets", POOL_NS),
    ("update", "secrets", POOL_NS), ("create", "secrets", "kube-system"),
    ("create", "daemonsets.apps", "kube-system"), ("create", "daemonsets.apps", OTHER_NS),
    ("create", "deployments.apps", OTHER_NS), ("create", "pods", POOL_NS),
    ("create", "clusterrolebindings.rbac.authorization.k8s.io", None),
    ("delete", "clusterrolebindings.rbac.authorization.k8s.io/cluster-admin", None),
    ("update", "clusterrolebindings.rbac.authorization.k8s.io/cluster-admin", None),
    ("bind", "clusterroles.rbac.authorization.k8s.io/cluster-admin", None),
    ("bind", "clusterroles.rbac.authorization.k8s.io/admin", POOL_NS),
    ("escalate", "roles.rbac.authorization.k8s.io", POOL_NS),
    ("create", "clusterroles.rbac.authorization.k8s.io", None),
    ("patch", "nodes", None), ("impersonate", "serviceaccounts", POOL_NS),
    ("update", "leases.coordination.k8s.io/someone-elses", RELEASE_NS), ("get", "configmaps", "kube-system"),
]


def _can_i(kube: LocalCluster, verb: str, resource: str, namespace: str | None) -> bool:
    """``kubectl auth can-i`` as the operator's ServiceAccount; ``resource`` may be TYPE/NAME or TYPE/status."""
    args = ["auth", "can-i", verb]
    if resource.endswith("/status"):
        args += [resource.removesuffix("/status"), "--subresource=status"]
    else:
        args.append(resource)
    args += ["-n", namespace] if namespace else []
    out = kube.kubectl(*args, f"--as={OPERATOR}", check=False)
    answer = (out.stdout.strip().splitlines() or [""])[-1]
    assert answer in ("yes", "no"), f"kubectl {' '.join(args)}: {out.stdout}{out.stderr}"
    return answer == "yes"


def _table(kube: LocalCluster, rows: list[tuple[str, str, str | None]], title: str) -> list[tuple[str, bool]]:
    results = [(f"{v} {r} {'-n ' + ns if ns else '(cluster)'}", _can_i(kube, v, r, ns)) for v, r, ns in rows]
    print(f"\n{title}")
    for what, yes in results:
        print(f"  {'yes' if yes else 'no ':3}  {what}")
    return results


def test_operator_service_account_can_do_its_job_and_nothing_else(kube: LocalCluster, installed: str) -> None:
    needed = _table(kube, NEEDED, "kubectl auth can-i as the operator (watchNamespaces set): needed")
    forbidden = _table(kube, FORBIDDEN, "kubectl auth can-i as the operator (watchNamespaces set): must not")
    assert [w for w, yes in needed if not yes] == []
    assert [w for w, yes in forbidden if yes] == []


def test_cluster_wide_operator_still_cannot_read_secrets_or_touch_other_bindings(
        kube: LocalCluster, installed: str, render_text: Callable[..., str]) -> None:
    """Without watchNamespaces the namespaced rights are bound cluster-wide; RBAC then allows a DaemonSet in
    kube-system, and the operator-writes admission policy is what refuses it."""
    cluster_rbac = render_text("--show-only", "templates/rbac.yaml", release=RELEASE, namespace=RELEASE_NS)
    binding = next(d for d in yaml.safe_load_all(cluster_rbac)
                   if d and d["kind"] == "ClusterRoleBinding" and d["metadata"]["name"] == f"{RELEASE}-daybreak-operator")
    kube.kubectl("apply", "-f", "-", stdin=json.dumps(binding))
    try:
        rows = [("get", "secrets", "kube-system"), ("list", "secrets", None), ("watch", "secrets", POOL_NS),
                ("delete", "clusterrolebindings.rbac.authorization.k8s.io/cluster-admin", None),
                ("create", "clusterrolebindings.rbac.authorization.k8s.io", None),
                ("bind", "clusterroles.rbac.authorization.k8s.io/cluster-admin", None),
                ("create", "daemonsets.apps", "kube-system"), ("create", "daemonsets.apps", OTHER_NS)]
        results = dict(_table(kube, rows, "kubectl auth can-i as the operator (cluster-wide)"))
        assert [w for w, yes in results.items() if yes] == [
            "create daemonsets.apps -n kube-system", f"create daemonsets.apps -n {OTHER_NS}"]
        for ns, why in (("kube-system", "poolPolicy.deniedNamespaces"), (OTHER_NS, "hostPID")):
            out = _as_operator(kube, "create", _privileged_daemonset(), namespace=ns)
            assert out.returncode != 0 and "daybreak-operator-writes" in out.stderr and why in out.stderr, out.stderr
    finally:
        kube.kubectl("delete", "clusterrolebinding", f"{RELEASE}-daybreak-operator", check=False)


# -- admission of the operator's own writes ----------------------------------------------------------------
def _privileged_daemonset() -> dict[str, Any]:
    """What finding 2 asked for: a privileged, host-PID DaemonSet with the host's root mounted."""
    return {"apiVersion": "apps/v1", "kind": "DaemonSet", "metadata": {"name": "x-agent"},
            "spec": {"selector": {"matchLabels": {"a": "x"}}, "template": {
                "metadata": {"labels": {"a": "x"}},
                "spec": {"hostPID": True, "serviceAccountName": "x-daybreak-agent",
                         "containers": [{"name": "c", "image": IMAGE, "securityContext": {"privileged": True}}]}}}}


def _as_operator(kube: LocalCluster, verb: str, manifest: dict[str, Any], *, namespace: str) -> Any:
    return kube.kubectl(f"--as={OPERATOR}", "-n", namespace, verb, "--dry-run=server", "-f", "-",
                        stdin=json.dumps(manifest), check=False)


def _wait_operator_policy(kube: LocalCluster) -> None:
    deadline = time.monotonic() + 60
    while True:
        out = _as_operator(kube, "create", _privileged_daemonset(), namespace=POOL_NS)
        if "daybreak-operator-writes" in out.stderr:
            return
        assert time.monotonic() < deadline, f"the operator-writes policy never took effect: {out.stderr}"
        time.sleep(0.5)


def _built_pool(**spec: Any) -> pool_mod.PoolChildren:
    body = _pool("real", **spec)
    body["metadata"].update({"uid": "u", "generation": 1})
    return pool_mod.build(KVPool.from_body(body), image=IMAGE)


def test_operator_writes_beyond_the_tiers_are_refused_by_the_api_server(kube: LocalCluster, installed: str) -> None:
    _wait_operator_policy(kube)
    # What the operator really builds passes: a pool with every tier and rdma, and a PD deployment.
    real = _built_pool(transport={"preference": ["shm", "rdma", "tcp"]},
                       tiers={"dram": {"bytesPerNode": "1Gi"},
                              "ssd": {"path": "/var/lib/daybreak/kv", "bytesPerNode": "1Gi"}})
    ds = next(m for m in real.applied if m["kind"] == "DaemonSet")
    assert _as_operator(kube, "create", ds, namespace=POOL_NS).returncode == 0
    non_root = _built_pool(transport={"preference": ["tcp"]},
                           tiers={"ssd": {"path": "/mnt/kv", "bytesPerNode": "1Gi"}})
    ds2 = next(m for m in non_root.applied if m["kind"] == "DaemonSet")
    out = _as_operator(kube, "create", ds2, namespace=POOL_NS)
    assert out.returncode == 0, out.stderr
    pdd_body = yaml.safe_load((ROOT / "examples" / "pddeployment-sim.yaml").read_text())
    pdd_body["metadata"].update({"namespace": POOL_NS, "uid": "u2", "generation": 1})
    pool_body = _pool("kv-minimal")
    pool_body["metadata"].update({"uid": "u3", "generation": 1})
    engines = pdd_mod.build(PDDeployment.from_body(pdd_body), KVPool.from_body(pool_body), image=IMAGE)
    for _, manifest in engines.applied:
        if manifest["kind"] == "Deployment":
            out = _as_operator(kube, "create", manifest, namespace=POOL_NS)
            assert out.returncode == 0, out.stderr
    # The engines' and router's own rights (read the pool, list EndpointSlices): bound to their own account only.
    serving_role = next(m for m in engines.access if m["kind"] == "Role")
    kube.kubectl("apply", "-n", POOL_NS, "-f", "-", stdin=json.dumps(serving_role))  # what a binding is checked against
    serving_binding = next(m for m in engines.access if m["kind"] == "RoleBinding")
    out = _as_operator(kube, "create", serving_binding, namespace=POOL_NS)
    assert out.returncode == 0, out.stderr

    refused: list[tuple[dict[str, Any], str]] = [(_privileged_daemonset(), "hostPID")]
    etc = copy.deepcopy(ds)
    etc["spec"]["template"]["spec"]["volumes"].append({"name": "etc", "hostPath": {"path": "/etc"}})
    refused.append((etc, "host paths /etc"))
    evil = copy.deepcopy(ds)
    evil["spec"]["template"]["spec"]["containers"][0]["image"] = "evil.example/rootkit:1"
    refused.append((evil, "agent images must be"))
    caps = copy.deepcopy(ds)
    caps["spec"]["template"]["spec"]["containers"][0]["securityContext"]["capabilities"]["add"] = ["SYS_ADMIN"]
    refused.append((caps, "add capabilities"))
    engine = next(m for _, m in engines.applied if m["kind"] == "Deployment")
    stolen = copy.deepcopy(engine)
    stolen["spec"]["template"]["spec"]["serviceAccountName"] = "kv-minimal-daybreak-agent"
    refused.append((stolen, "serviceAccountName"))
    widened = copy.deepcopy(serving_binding)
    widened["subjects"][0]["name"] = "default"
    refused.append((widened, "per-pool Role"))
    hostnet = copy.deepcopy(engine)
    hostnet["spec"]["template"]["spec"]["hostNetwork"] = True
    refused.append((hostnet, "only agents use hostNetwork"))
    for manifest, why in refused:
        out = _as_operator(kube, "create", manifest, namespace=POOL_NS)
        assert out.returncode != 0, f"admitted: {manifest['metadata']['name']} ({why})"
        assert "daybreak-operator-writes" in out.stderr and why in out.stderr, out.stderr
    # Issue 22 finding 4: each engine escalation, written straight into the engine Deployment the operator
    # builds (its own checks bypassed: a bug or a stolen token), is refused by the API server too.
    for case in ESCALATIONS:
        out = _as_operator(kube, "create", case.workload(engine), namespace=POOL_NS)
        assert out.returncode != 0, f"admitted: {case.name}"
        assert "daybreak-operator-writes" in out.stderr and case.workload_field() in out.stderr, (case.name,
                                                                                                 out.stderr)
    # Agents' ports: inside poolPolicy.agentPortRange (hostNetwork makes every container port a host port).
    squat = copy.deepcopy(ds)
    squat["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = 10250
    out = _as_operator(kube, "create", squat, namespace=POOL_NS)
    assert out.returncode != 0 and "poolPolicy.agentPortRange" in out.stderr, out.stderr


def test_operator_may_list_only_agent_service_accounts_in_the_agent_binding(kube: LocalCluster,
                                                                            installed: str) -> None:
    _wait_operator_policy(kube)
    binding = json.loads(kube.kubectl("get", "clusterrolebinding", "daybreak-agents", "-o", "json").stdout)
    binding["subjects"] = [{"kind": "ServiceAccount", "name": "kv-minimal-daybreak-agent", "namespace": POOL_NS}]
    ok = kube.kubectl(f"--as={OPERATOR}", "replace", "--dry-run=server", "-f", "-", stdin=json.dumps(binding),
                      check=False)
    assert ok.returncode == 0, ok.stderr
    binding["subjects"].append({"kind": "User", "name": TENANT, "apiGroup": "rbac.authorization.k8s.io"})
    out = kube.kubectl(f"--as={OPERATOR}", "replace", "--dry-run=server", "-f", "-", stdin=json.dumps(binding),
                       check=False)
    assert out.returncode != 0 and "daybreak-operator-writes" in out.stderr, out.stderr


def test_policy_configmap_is_what_the_operator_reads(installed: str, tmp_path: Path) -> None:
    """The admission policies' parameter object, mounted as the operator's --policy-dir, gives the same policy."""
    from daybreak.operator.pool_policy import PoolPolicy
    from daybreak.operator.settings import OperatorSettings

    cm = next(d for d in yaml.safe_load_all(installed) if d and d["kind"] == "ConfigMap"
              and d["metadata"]["name"] == f"{RELEASE}-daybreak-pool-policy")
    for key, value in cm["data"].items():
        (tmp_path / key).write_text(value)
    settings = OperatorSettings.load(overrides={"policy_dir": str(tmp_path)}, environ={})
    assert settings.pool_policy == PoolPolicy()
