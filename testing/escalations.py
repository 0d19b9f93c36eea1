"""The engine-pod escalations of issue 22 (finding 4), one table for every layer that must refuse them.

A tenant who may only create PDDeployments sent each of these in a role's partial template (or in
``spec.engine.env``). The chart's admission policy, the operator's own checks and the operator's write
policy must each refuse every one, naming the field; tests/chart/test_chart_security.py and
tests/operator/test_pool_policy_units.py run this same table against the CEL and the Python rules.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from dataclasses import field as default
from typing import Any

POOL_SECRET = "kv-minimal-token"  # the pool secret of examples/kvpool-minimal.yaml (generated name)


@dataclass(frozen=True)
class Escalation:
    """``template``: the decode role's partial template; ``env``: entries of spec.engine.env. ``field``: the
    path (below ``spec.decode.template`` or ``spec``) a refusal must start with."""

    name: str
    field: str
    template: dict[str, Any] = default(default_factory=dict)
    env: list[dict[str, Any]] = default(default_factory=list)

    def admission_field(self) -> str:
        """The field as the PDDeployment names it."""
        return self.field if self.env else f"spec.decode.template.{self.field}"

    def workload_field(self) -> str:
        """The field as the built Deployment names it (the engine's env is its container's)."""
        return "spec.template.spec.containers" if self.env else f"spec.template.{self.field}"

    def pdd(self, body: dict[str, Any]) -> dict[str, Any]:
        """``body`` (a PDDeployment) carrying this escalation."""
        out = copy.deepcopy(body)
        if self.template:
            out["spec"]["decode"]["template"] = copy.deepcopy(self.template)
        if self.env:
            out["spec"].setdefault("engine", {})["env"] = copy.deepcopy(self.env)
        return out

    def workload(self, deployment: dict[str, Any]) -> dict[str, Any]:
        """A built engine Deployment with this escalation written into it (what a stolen operator token,
        or an operator bug, would send past the operator's own checks)."""
        from daybreak.operator.deployment import _merge

        out = copy.deepcopy(deployment)
        template = out["spec"]["template"]
        if self.template:
            out["spec"]["template"] = _merge(template, self.template)
        for entry in self.env:
            env = template["spec"]["containers"][0]["env"]
            env[:] = [e for e in env if e["name"] != entry["name"]] + [copy.deepcopy(entry)]
        return out


def _container(**fields: Any) -> dict[str, Any]:
    return {"spec": {"containers": [{"name": "engine", **fields}]}}


SECRET_REF = {"secretKeyRef": {"name": POOL_SECRET, "key": "token"}}

ESCALATIONS = [
    Escalation("run-as-root", "spec.securityContext", {"spec": {"securityContext": {"runAsUser": 0}}}),
    Escalation("container-root", "spec.containers", _container(securityContext={"runAsUser": 0})),
    Escalation("seccomp-unconfined", "spec.containers",
               _container(securityContext={"seccompProfile": {"type": "Unconfined"}})),
    Escalation("apparmor-unconfined", "spec.securityContext",
               {"spec": {"securityContext": {"appArmorProfile": {"type": "Unconfined"}}}}),
    Escalation("apparmor-annotation", "metadata.annotations",
               {"metadata": {"annotations": {"container.apparmor.security.beta.kubernetes.io/engine": "unconfined"}}}),
    Escalation("host-port", "spec.containers",
               _container(ports=[{"containerPort": 10250, "hostPort": 10250, "protocol": "TCP"}])),
    Escalation("node-name", "spec.nodeName", {"spec": {"nodeName": "gpu-0"}}),
    Escalation("keyless-toleration", "spec.tolerations", {"spec": {"tolerations": [{"operator": "Exists"}]}}),
    Escalation("priority-class", "spec.priorityClassName", {"spec": {"priorityClassName": "system-node-critical"}}),
    Escalation("nfs", "spec.volumes", {"spec": {"volumes": [
        {"name": "nfs", "nfs": {"server": "10.0.0.1", "path": "/exports"}}]}}),
    Escalation("inline-csi", "spec.volumes", {"spec": {"volumes": [
        {"name": "csi", "csi": {"driver": "secrets-store.csi.k8s.io"}}]}}),
    Escalation("pool-secret-in-template", "spec.containers",
               _container(env=[{"name": "STOLEN", "valueFrom": copy.deepcopy(SECRET_REF)}])),
    Escalation("pool-secret-volume", "spec.volumes", {"spec": {"volumes": [
        {"name": "stolen", "secret": {"secretName": POOL_SECRET}}]}}),
    Escalation("token-override", "spec.engine.env",
               env=[{"name": "DAYBREAK_POOL_TOKEN", "valueFrom": copy.deepcopy(SECRET_REF)}]),
]
