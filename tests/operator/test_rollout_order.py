"""Pure builder rules for elastic PD: planner replicas win within bounds, and a kvNamespace change rolls prefill first."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from daybreak.api.kvpool import KVPool
from daybreak.api.pddeployment import PDDeployment, Role
from daybreak.operator import deployment as pdd_mod

ROOT = Path(__file__).resolve().parents[2]


def _load(name: str) -> dict[str, Any]:
    body = yaml.safe_load((ROOT / "examples" / name).read_text())
    body["metadata"].update({"namespace": "ns1", "uid": "uid-1", "generation": 3})
    return dict(body)


def _pdd(status: dict[str, Any] | None = None, **spec: Any) -> PDDeployment:
    body = _load("pddeployment-sim.yaml")
    body["spec"].update(spec)
    if status:
        body["status"] = status
    return PDDeployment.from_body(body)


def _deployments(pdd: PDDeployment) -> dict[Role, dict[str, Any]]:
    built = pdd_mod.build(pdd, KVPool.from_body(_load("kvpool-minimal.yaml")), image="img:1")
    out = {}
    for role, m in built.applied:
        if m["kind"] == "Deployment" and role != Role.ROUTER:
            out[role] = m
    return out


def _live(m: dict[str, Any], *, done: bool) -> dict[str, Any]:
    """A Deployment as the API reports it: rolled out (done) or mid-rollout."""
    n = m["spec"]["replicas"]
    return {**m, "metadata": {**m["metadata"], "generation": 2},
            "status": {"observedGeneration": 2, "replicas": n if done else n + 1, "updatedReplicas": n,
                       "availableReplicas": n, "readyReplicas": n}}


def test_planner_replicas_are_rendered_within_bounds_only_while_autoscaling() -> None:
    scaled = {"decode": {"desiredReplicas": 9}, "prefill": {"desiredReplicas": 0}}
    bounds = {"prefill": {"replicas": 1, "minReplicas": 1, "maxReplicas": 4},
              "decode": {"replicas": 2, "minReplicas": 1, "maxReplicas": 6}}
    on = _pdd(scaled, autoscaling={"enabled": True}, **bounds)
    assert pdd_mod.role_replicas(on, Role.DECODE) == 6 and pdd_mod.role_replicas(on, Role.PREFILL) == 1
    assert _deployments(on)[Role.DECODE]["spec"]["replicas"] == 6
    off = _pdd(scaled, **bounds)
    assert _deployments(off)[Role.DECODE]["spec"]["replicas"] == 2
    status = pdd_mod.status(off, pool=None, workloads={}, revision=None,
                            existing={"decode": {"desiredReplicas": 9}}, generation=1)
    assert status["decode"]["desiredReplicas"] is None  # autoscaling off: the decision is dropped


def test_a_kv_namespace_change_holds_decode_until_prefill_rolled_out() -> None:
    old = _pdd()
    old_children = _deployments(old)
    new = _pdd(model={**old.spec.model.to_dict(), "revision": "f" * 40})
    assert new.spec.kv_namespace() != old.spec.kv_namespace()
    new_children = _deployments(new)
    # Prefill still has the old template: decode keeps its old one.
    live = {Role.PREFILL: _live(old_children[Role.PREFILL], done=True),
            Role.DECODE: _live(old_children[Role.DECODE], done=True)}
    hold = pdd_mod.rollout_holds(new, live)
    assert set(hold) == {Role.DECODE}
    held = pdd_mod.build(new, KVPool.from_body(_load("kvpool-minimal.yaml")), image="img:1", hold=hold)
    decode = next(m for r, m in held.applied if r == Role.DECODE and m["kind"] == "Deployment")
    assert pdd_mod.template_namespace(decode) == old.spec.kv_namespace()
    # Prefill on the new template but still rolling: still held.
    live[Role.PREFILL] = _live(new_children[Role.PREFILL], done=False)
    assert set(pdd_mod.rollout_holds(new, live)) == {Role.DECODE}
    assert not pdd_mod.rolled_out(new, live)
    # Prefill done: decode is released; once it is rolled out too, the old namespace can retire.
    live[Role.PREFILL] = _live(new_children[Role.PREFILL], done=True)
    assert pdd_mod.rollout_holds(new, live) == {}
    live[Role.DECODE] = _live(new_children[Role.DECODE], done=True)
    assert pdd_mod.rolled_out(new, live)


def test_a_change_that_keeps_the_namespace_holds_nothing() -> None:
    old = _pdd()
    live = {r: _live(m, done=True) for r, m in _deployments(old).items()}
    changed = _pdd(engine={"kind": "sim", "args": ["--max-batch", "8"]})
    assert changed.spec.kv_namespace() == old.spec.kv_namespace()
    assert pdd_mod.rollout_holds(changed, live) == {}
    assert _deployments(changed)[Role.DECODE]["spec"]["template"]["metadata"]["labels"][
        pdd_mod.KV_NAMESPACE_ANNOTATION] == old.spec.kv_namespace()
