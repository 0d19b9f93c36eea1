"""The operator's own policy check against a real API server: a pool its policy refuses gets a condition
naming the field and no children, and is built once it is fixed."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import yaml

from daybreak.devenv.cluster import LocalCluster
from daybreak.testing.operator_process import OperatorProcess

ROOT = Path(__file__).resolve().parents[2]
NS = "policy-op"
T = TypeVar("T")


def _wait(what: str, probe: Callable[[], T | None], op: OperatorProcess, timeout: float = 60) -> T:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = probe()
        if value:
            return value
        time.sleep(0.3)
    raise AssertionError(f"timed out waiting for {what}\n{op.log()[-4000:]}")


def _get(kube: LocalCluster, *args: str) -> dict[str, Any] | None:
    out = kube.kubectl("get", "-n", NS, *args, "-o", "json", check=False)
    return json.loads(out.stdout) if out.returncode == 0 else None


def _ready(pool: dict[str, Any] | None) -> dict[str, Any]:
    return next((c for c in ((pool or {}).get("status") or {}).get("conditions") or [] if c["type"] == "Ready"), {})


def test_a_pool_the_operators_policy_refuses_gets_a_condition_and_no_children(kube: LocalCluster,
                                                                               tmp_path: Path) -> None:
    kube.kubectl("apply", "-f", str(ROOT / "crds"))
    kube.kubectl("create", "namespace", NS, check=False)
    # Tighter than at admission (as after a policy change): SSD tiers only under /mnt/kv, inside the
    # admission policy's roots (another test of this session may have installed that policy).
    policy = tmp_path / "policy"
    policy.mkdir()
    (policy / "allowedSSDRoots").write_text("/mnt/kv")
    op = OperatorProcess(kubeconfig=kube.kubeconfig, log_path=tmp_path / "operator.log", namespace=NS,
                         identity="policy", lease_namespace=NS, resync_seconds=2.0,
                         env={"DAYBREAK_OPERATOR_POLICY_DIR": str(policy)})
    op.start()
    try:
        pool = yaml.safe_load((ROOT / "examples" / "kvpool-minimal.yaml").read_text())
        pool["metadata"]["name"] = "tight"
        pool["spec"]["tiers"]["ssd"] = {"path": "/mnt/nvme0/kv", "bytesPerNode": "1Gi"}
        kube.kubectl("apply", "-n", NS, "-f", "-", stdin=yaml.safe_dump(pool))
        ready = _wait("PolicyViolation", lambda: (c := _ready(_get(kube, "kvp", "tight")))
                      .get("reason") == "PolicyViolation" and c, op)
        assert ready["status"] == "False"
        assert ready["message"].startswith("spec.tiers.ssd.path: host path '/mnt/nvme0/kv'"), ready["message"]
        assert _get(kube, "daemonset", "tight-agent") is None
        assert _get(kube, "serviceaccount", "tight-daybreak-agent") is None
        events = (_get(kube, "events", "--field-selector=involvedObject.name=tight") or {}).get("items") or []
        assert any(e["reason"] == "PolicyViolation" and e["type"] == "Warning" for e in events)

        kube.kubectl("patch", "kvp", "-n", NS, "tight", "--type=merge",
                     "-p", '{"spec":{"tiers":{"ssd":{"path":"/mnt/kv/tight"}}}}')
        ds = _wait("the agent DaemonSet once fixed", lambda: _get(kube, "daemonset", "tight-agent"), op)
        volumes = {v["name"]: v for v in ds["spec"]["template"]["spec"]["volumes"]}
        assert volumes["ssd"]["hostPath"]["path"] == "/mnt/kv/tight"
        _wait("PolicyViolation cleared", lambda: _ready(_get(kube, "kvp", "tight")).get("reason") != "PolicyViolation",
              op)
        assert "policy" in op.log() and "Traceback" not in op.log()
    finally:
        op.stop()
        kube.kubectl("delete", "namespace", NS, "--wait=false", check=False)


def test_the_shared_agent_binding_follows_the_live_pools(kube: LocalCluster, tmp_path: Path) -> None:
    """Subjects of pools that vanished while no operator ran are swept; subjects that are not ours stay."""
    ns = "binding-op"
    kube.kubectl("apply", "-f", str(ROOT / "crds"))
    kube.kubectl("create", "namespace", ns, check=False)
    ghost = {"kind": "ServiceAccount", "name": "ghost-daybreak-agent", "namespace": ns}
    elsewhere = {"kind": "ServiceAccount", "name": "x-daybreak-agent", "namespace": "not-watched"}
    human = {"kind": "User", "name": "bob", "apiGroup": "rbac.authorization.k8s.io"}
    binding = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
               "metadata": {"name": "daybreak-agents"},
               "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "daybreak-agent"},
               "subjects": [ghost, elsewhere, human]}
    kube.kubectl("apply", "-f", "-", stdin=json.dumps(binding))
    pool = yaml.safe_load((ROOT / "examples" / "kvpool-minimal.yaml").read_text())
    kube.kubectl("apply", "-n", ns, "-f", "-", stdin=yaml.safe_dump(pool))
    op = OperatorProcess(kubeconfig=kube.kubeconfig, log_path=tmp_path / "operator.log", namespace=ns,
                         identity="binding", lease_namespace=ns, resync_seconds=2.0)
    op.start()
    live = {"kind": "ServiceAccount", "name": "kv-minimal-daybreak-agent", "namespace": ns}

    def subjects() -> list[dict[str, Any]]:
        out = kube.kubectl("get", "clusterrolebinding", "daybreak-agents", "-o", "json")
        return list(json.loads(out.stdout).get("subjects") or [])

    try:
        _wait("ghost swept and live pool bound", lambda: ghost not in subjects() and live in subjects(), op)
        assert elsewhere in subjects() and human in subjects()  # outside the operator's scope, or not an agent
        kube.kubectl("delete", "kvp", "-n", ns, "kv-minimal")
        _wait("deleted pool unbound", lambda: live not in subjects(), op)
        assert "resync crashed" not in op.log()
    finally:
        op.stop()
        kube.kubectl("delete", "namespace", ns, "--wait=false", check=False)
        kube.kubectl("delete", "clusterrolebinding", "daybreak-agents", check=False)
