"""The Helm chart: CRDs in sync, renders what HA needs, and its RBAC is enough for an operator running in-cluster."""

from __future__ import annotations

import json
import ssl
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from daybreak.devenv import tools
from daybreak.devenv.cluster import LocalCluster
from daybreak.testing.operator_process import OperatorProcess

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "daybreak"
RELEASE_NS = "daybreak-chart"
WATCHED_NS = "chart-test"


def helm(*args: str) -> str:
    out = subprocess.run([str(tools.find("helm")), *args], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


def render(*extra: str) -> list[dict[str, Any]]:
    text = helm("template", "dbk", str(CHART), "--namespace", RELEASE_NS, "--kube-version", "1.37.2", *extra)
    return [d for d in yaml.safe_load_all(text) if d]


def test_chart_crds_match_the_generated_crds() -> None:
    chart = {p.name: p.read_text() for p in (CHART / "crds").glob("*.yaml")}
    generated = {p.name: p.read_text() for p in (ROOT / "crds").glob("*.yaml")}
    assert chart.keys() == generated.keys(), "run: cp crds/*.yaml charts/daybreak/crds/"
    stale = [name for name in generated if chart[name] != generated[name]]
    assert not stale, f"charts/daybreak/crds is stale for {stale}; run: cp crds/*.yaml charts/daybreak/crds/"


def test_chart_lints_and_renders_two_replicas_with_leader_election() -> None:
    helm("lint", str(CHART), "--kube-version", "1.37.2")
    docs = render()
    by_kind: dict[str, list[dict[str, Any]]] = {}
    for d in docs:
        by_kind.setdefault(d["kind"], []).append(d)
    (deployment,) = by_kind["Deployment"]
    assert deployment["spec"]["replicas"] == 2
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert container["command"] == ["daybreak", "operator"]
    assert "--all-namespaces" in container["args"]
    assert f"--lease-namespace={RELEASE_NS}" in container["args"]
    assert deployment["spec"]["template"]["spec"]["serviceAccountName"] == "dbk-daybreak-operator"
    assert {sa["metadata"]["name"] for sa in by_kind["ServiceAccount"]} == {"dbk-daybreak-operator"}
    roles = {r["metadata"]["name"]: r for r in by_kind["ClusterRole"]}
    assert set(roles) == {"dbk-daybreak-operator", "dbk-daybreak-operator-cluster", "daybreak-agent"}
    bind = [r for r in roles["dbk-daybreak-operator-cluster"]["rules"] if "bind" in r["verbs"]]
    assert bind == [{"apiGroups": ["rbac.authorization.k8s.io"], "resources": ["clusterroles"], "verbs": ["bind"],
                     "resourceNames": ["daybreak-agent"]}]
    assert not [r for r in roles["dbk-daybreak-operator"]["rules"] if {"bind", "escalate"} & set(r["verbs"])]
    policies = {p["metadata"]["name"] for p in by_kind["ValidatingAdmissionPolicy"]}
    assert policies == {"daybreak-agent-own-node", "daybreak-pool-policy", "daybreak-deployment-policy",
                        "daybreak-operator-writes"}
    assert by_kind["PodDisruptionBudget"][0]["spec"]["minAvailable"] == 1
    namespaced = render("--set", f"operator.watchNamespaces={{{WATCHED_NS}}}", "--set",
                        "agentAdmissionPolicy.enabled=false")
    args = next(d for d in namespaced if d["kind"] == "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert f"--namespace={WATCHED_NS}" in args
    assert {p["metadata"]["name"] for p in namespaced if p["kind"] == "ValidatingAdmissionPolicy"} == {
        "daybreak-pool-policy", "daybreak-deployment-policy", "daybreak-operator-writes"}
    # Confined: the namespaced rights are a RoleBinding in the watched namespace, not a cluster binding.
    bindings = {(d["kind"], d["metadata"].get("namespace"), d["metadata"]["name"]) for d in namespaced
                if d["kind"] in ("RoleBinding", "ClusterRoleBinding")}
    assert ("RoleBinding", WATCHED_NS, "dbk-daybreak-operator") in bindings
    assert ("ClusterRoleBinding", None, "dbk-daybreak-operator") not in bindings


def test_operator_in_cluster_with_the_charts_service_account(kube: LocalCluster, tmp_path: Path) -> None:
    """Confined to one namespace, the chart's RBAC, admission policies and policy ConfigMap are enough."""
    kube.kubectl("apply", "-f", str(ROOT / "crds"))
    for ns in (RELEASE_NS, WATCHED_NS):
        kube.kubectl("create", "namespace", ns, check=False)
    docs = render("--set", f"operator.watchNamespaces={{{WATCHED_NS}}}")
    kube.kubectl("apply", "-f", "-", stdin="\n---\n".join(yaml.safe_dump(d) for d in docs))
    # What the kubelet would mount from the chart's policy ConfigMap (--policy-dir).
    policy_dir = tmp_path / "policy"
    policy_dir.mkdir()
    cm = next(d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "dbk-daybreak-pool-policy")
    for key, value in cm["data"].items():
        (policy_dir / key).write_text(value)
    # What the kubelet would mount into the operator's Pod: a token of the chart's ServiceAccount.
    sa_dir = tmp_path / "serviceaccount"
    sa_dir.mkdir()
    token = kube.kubectl("create", "token", "-n", RELEASE_NS, "dbk-daybreak-operator", "--duration=1h").stdout.strip()
    (sa_dir / "token").write_text(token)
    (sa_dir / "ca.crt").write_bytes(Path(kube.pki.ca_cert).read_bytes())
    (sa_dir / "namespace").write_text(RELEASE_NS)
    op = OperatorProcess(kubeconfig=None, log_path=tmp_path / "operator.log", namespace=WATCHED_NS,
                         identity="in-cluster", lease_namespace=RELEASE_NS, resync_seconds=2.0,
                         env={"KUBERNETES_SERVICE_HOST": "127.0.0.1", "KUBERNETES_SERVICE_PORT": str(kube.apiserver_port),
                              "DAYBREAK_OPERATOR_SERVICE_ACCOUNT_DIR": str(sa_dir), "KUBECONFIG": "/nonexistent",
                              "DAYBREAK_OPERATOR_POLICY_DIR": str(policy_dir),
                              # The chart's image (what --image is in the chart): the admission policy on the
                              # operator's writes accepts only it for agents.
                              "DAYBREAK_OPERATOR_IMAGE": cm["data"]["operatorImage"]})
    op.start()
    try:
        pool = yaml.safe_load((ROOT / "examples" / "kvpool-minimal.yaml").read_text())
        pdd = yaml.safe_load((ROOT / "examples" / "pddeployment-sim.yaml").read_text())
        kube.kubectl("apply", "-n", WATCHED_NS, "-f", "-", stdin=yaml.safe_dump_all([pool, pdd]))
        with kube.api() as api:
            wanted = [f"/apis/apps/v1/namespaces/{WATCHED_NS}/daemonsets/kv-minimal-agent",
                      f"/api/v1/namespaces/{WATCHED_NS}/secrets/kv-minimal-token",
                      f"/apis/apps/v1/namespaces/{WATCHED_NS}/deployments/sim-llama-decode",
                      f"/apis/apps/v1/namespaces/{WATCHED_NS}/deployments/sim-llama-router"]
            deadline = time.monotonic() + 90
            missing = wanted
            while missing and time.monotonic() < deadline:
                missing = [p for p in wanted if api.get(p).status_code != 200]
                time.sleep(0.5)
            assert not missing, f"not created: {missing}\n{op.log()[-4000:]}"
            agent = {"kind": "ServiceAccount", "name": "kv-minimal-daybreak-agent", "namespace": WATCHED_NS}
            deadline = time.monotonic() + 30
            while agent not in (api.get("/apis/rbac.authorization.k8s.io/v1/clusterrolebindings/daybreak-agents")
                                .json().get("subjects") or []):
                assert time.monotonic() < deadline, f"agent not bound\n{op.log()[-4000:]}"
                time.sleep(0.5)
            status = wait_status(api, f"/apis/daybreak.dev/v1alpha1/namespaces/{WATCHED_NS}/pddeployments/sim-llama")
            assert status["kvNamespace"].startswith("kv1-")
            lease = api.get(f"/apis/coordination.k8s.io/v1/namespaces/{RELEASE_NS}/leases/daybreak-operator").json()
            assert lease["spec"]["holderIdentity"].startswith("in-cluster_")
            # The agents' Role carries the credential minter's rights: the chart's operator could grant them.
            role = api.get(f"/apis/rbac.authorization.k8s.io/v1/namespaces/{WATCHED_NS}/roles/kv-minimal-agent").json()
            assert {"apiGroups": [""], "resources": ["secrets"], "verbs": ["create"]} in role["rules"]
        # The operator-writes policy: the serving binding passes (above); other subjects are refused.
        with httpx.Client(base_url=kube.server, timeout=30, headers={"Authorization": f"Bearer {token}"},
                          verify=ssl.create_default_context(cafile=str(kube.pki.ca_cert))) as as_operator:
            def bind(name: str, role_name: str, subject: str) -> httpx.Response:
                body = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
                        "metadata": {"name": name},
                        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": role_name},
                        "subjects": [{"kind": "ServiceAccount", "name": subject, "namespace": WATCHED_NS}]}
                return as_operator.post(f"/apis/rbac.authorization.k8s.io/v1/namespaces/{WATCHED_NS}/rolebindings"
                                        "?dryRun=All", json=body)

            other = bind("sim-llama-serving", "sim-llama-serving", "default")
            assert other.status_code == 403 and "daybreak-operator-writes" in other.text, other.text
            crossed = bind("sim-llama-serving", "kv-minimal-agent", "sim-llama-serving")
            assert crossed.status_code == 403 and "daybreak-operator-writes" in crossed.text, crossed.text
            # What the operator itself writes passes admission; the name exists, so storage answers 409.
            own = bind("sim-llama-serving", "sim-llama-serving", "sim-llama-serving")
            assert own.status_code == 409, own.text
        log = op.log()
        assert "forbidden" not in log.lower(), log[-4000:]
        assert " 403 " not in log
    finally:
        op.stop()
        kube.kubectl("delete", "namespace", WATCHED_NS, "--wait=false", check=False)


def wait_status(api: httpx.Client, path: str) -> dict[str, Any]:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        status = api.get(path).json().get("status") or {}
        if status.get("observedGeneration"):
            return dict(status)
        time.sleep(0.5)
    raise AssertionError(f"no status on {path}: {json.dumps(status)}")


@pytest.mark.e2e
def test_helm_install_brings_up_two_operator_replicas_and_uninstalls_cleanly(cluster: LocalCluster) -> None:
    """What a platform engineer types: `helm install`, against a real apiserver with kwok kubelets."""
    ns = "daybreak-helm"
    helm("install", "dbh", str(CHART), "--kubeconfig", str(cluster.kubeconfig), "--namespace", ns,
         "--create-namespace", "--wait", "--timeout", "180s")
    try:
        status = json.loads(helm("status", "dbh", "--kubeconfig", str(cluster.kubeconfig), "-n", ns, "-o", "json"))
        assert status["info"]["status"] == "deployed"
        deployment = json.loads(cluster.kubectl("-n", ns, "get", "deployment", "dbh-daybreak-operator",
                                                "-o", "json").stdout)
        assert deployment["status"].get("availableReplicas") == 2
        crds = cluster.kubectl("get", "crd", "-o", "name").stdout.split()
        assert {"customresourcedefinition.apiextensions.k8s.io/kvpools.daybreak.dev",
                "customresourcedefinition.apiextensions.k8s.io/pddeployments.daybreak.dev",
                "customresourcedefinition.apiextensions.k8s.io/kvnodes.daybreak.dev"} <= set(crds)
    finally:
        helm("uninstall", "dbh", "--kubeconfig", str(cluster.kubeconfig), "-n", ns, "--wait", "--timeout", "120s")
    assert cluster.kubectl("get", "clusterrole", "daybreak-agent", check=False).returncode != 0
    left = cluster.kubectl("-n", ns, "get", "deployment,serviceaccount", "-l", "app.kubernetes.io/instance=dbh",
                           "-o", "name").stdout.split()
    assert left == []
