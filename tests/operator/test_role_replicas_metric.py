"""``daybreak_operator_role_replicas`` is what the operator applied: the planner's decision while autoscaling is on.

The serving dashboard's "Replicas per role" panel draws this gauge; it used to report the spec's
replicas, so a demo run that scaled 1 -> 3 showed a flat line at 1.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import yaml

from daybreak.api.pddeployment import PDDeployment
from daybreak.operator import metrics
from daybreak.operator.deployment_reconciler import DeploymentReconciler

ROOT = Path(__file__).resolve().parents[2]


def _body(status: dict[str, Any], **spec: Any) -> dict[str, Any]:
    body = yaml.safe_load((ROOT / "examples" / "pddeployment-sim.yaml").read_text())
    body["metadata"].update({"namespace": "ns-metric", "uid": "uid-1", "generation": 3})
    body["spec"].update(spec)
    body["status"] = status
    return dict(body)


def _gauge(name: str, role: str) -> float | None:
    return metrics.REGISTRY.get_sample_value("daybreak_operator_role_replicas",
                                             {"namespace": "ns-metric", "deployment": name, "role": role})


def test_the_gauge_follows_the_planners_replicas_and_the_spec_without_it() -> None:
    bounds = {"prefill": {"replicas": 1, "minReplicas": 1, "maxReplicas": 4},
              "decode": {"replicas": 2, "minReplicas": 1, "maxReplicas": 6}}
    scaled = {"decode": {"desiredReplicas": 5}, "prefill": {"desiredReplicas": 3}}
    for autoscaling, want in ((True, {"prefill": 3.0, "decode": 5.0}), (False, {"prefill": 1.0, "decode": 2.0})):
        body = _body(scaled, autoscaling={"enabled": autoscaling}, **bounds)
        pdd = PDDeployment.from_body(body)
        fake = SimpleNamespace(events=None)  # no earlier Deployments: no Scaled events to record
        DeploymentReconciler._record_changes(fake, body, pdd, {}, old_rev=None, new_rev="r1")  # type: ignore[arg-type]
        name = body["metadata"]["name"]
        assert {role: _gauge(name, role) for role in want} == want, autoscaling
