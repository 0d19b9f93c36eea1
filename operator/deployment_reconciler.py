"""Reconciles one PDDeployment: its prefill, decode and router Deployments, their access objects, its status.

One reconciler per kind, as kubebuilder's ``internal/controller/<kind>_controller.go``:
the term's workers hand it PDDeployment keys only. A FULL reconcile builds the
children (``deployment.build``, pure) and applies them through the shared
``Applier``; every reconcile recomputes status from the cached Deployments.
The rollout / retire state machine is ``rollout.Rollout``'s.

The planner's decisions arrive through ``submit_scale`` and are applied by the
object's next reconcile (one worker per key: the decision, ``status.lastScale``
and the Deployment apply never race another worker).
"""

from __future__ import annotations

import contextlib
import copy
import logging
from datetime import UTC, datetime
from typing import Any

from pydantic import ValidationError

from daybreak.api.kvpool import KVPool
from daybreak.api.pddeployment import LastScale, PDDeployment, Role
from daybreak.operator import deployment as pdd_mod
from daybreak.operator import metrics
from daybreak.operator.children import Applier
from daybreak.operator.events import WARNING, EventRecorder
from daybreak.operator.kube import DEPLOYMENT, KVPOOL, PDDEPLOYMENT, SERVICE, KubeClient, Manifest
from daybreak.operator.planner import Decision
from daybreak.operator.pool_policy import PolicyError
from daybreak.operator.rollout import Rollout
from daybreak.operator.settings import OperatorSettings
from daybreak.operator.state import PDD, POOL, Key, TermState
from daybreak.operator.status_writer import StatusWriter

logger = logging.getLogger(__name__)

ALL_ROLES = (*pdd_mod.ENGINE_ROLES, Role.ROUTER)


class DeploymentReconciler:
    """Makes one PDDeployment's desired state true; returns the result label of the reconcile metric."""

    def __init__(self, client: KubeClient, state: TermState, *, settings: OperatorSettings, applier: Applier,
                 events: EventRecorder, status: StatusWriter, rollout: Rollout) -> None:
        self.client = client
        self.state = state
        self.settings = settings
        self.applier = applier
        self.events = events
        self.status = status
        self.rollout = rollout
        # Planner decisions waiting for the object's next reconcile (which writes status and applies them).
        self.pending_scales: dict[tuple[str, str], dict[str, Decision]] = {}

    def submit_scale(self, *, namespace: str, name: str, decisions: list[Decision]) -> None:
        """Hand planner decisions to the object's reconcile (the autoscaler's ``SubmitScale``)."""
        pending = self.pending_scales.setdefault((namespace, name), {})
        for d in decisions:
            pending[d.role] = d
        self.state.request((PDD, namespace, name), full=True)

    def forget(self, ns: str, name: str) -> None:
        """The deployment was deleted: no stale series for it (the garbage collector removes the children)."""
        for role in ALL_ROLES:
            with contextlib.suppress(KeyError):
                metrics.ROLE_REPLICAS.remove(ns, name, role.value)

    async def reconcile(self, ns: str, name: str, *, full: bool) -> str:
        key: Key = (PDD, ns, name)
        body = self.state.pdds.get((ns, name))
        if body is None:
            body = await self.client.get_or_none(PDDEPLOYMENT, name, namespace=ns)
        if body is None:
            self.state.applied.discard(key)
            return "gone"
        stored = body  # what the API holds: status writes compare against it, not the planner's edit
        body = self._with_scale(ns, name, body)
        try:
            pdd = PDDeployment.from_body(body)
        except ValidationError as exc:
            await self.status.invalid(key, body=body, exc=exc)
            return "invalid"
        generation = body["metadata"].get("generation")
        pool_name = pdd.spec.pool_ref.name
        self.state.pool_of[(ns, name)] = pool_name
        pool_body = self.state.pools.get((ns, pool_name))
        if pool_body is None:
            pool_body = await self.client.get_or_none(KVPOOL, pool_name, namespace=ns)
            if pool_body is not None:
                self.state.cache_parent((POOL, ns, pool_name), pool_body)
        old_status = body.get("status") or {}
        if pool_body is None:
            status = pdd_mod.status(pdd, pool=None, workloads={}, revision=None, existing=old_status,
                                    generation=generation)
            was: dict[str, Any] = next(
                (c for c in old_status.get("conditions") or [] if c.get("type") == "Ready"), {})
            if was.get("reason") != "PoolNotFound":
                self.events.record(body, reason="PoolNotFound", type=WARNING,
                                   message=f"KVPool {pool_name!r} not found in namespace {ns!r}; waiting for it")
            await self.status.write(key, body=stored, status=status)
            self.state.needs_apply.add(key)  # apply everything once the pool shows up
            return "waiting"
        try:
            pool = KVPool.from_body(pool_body)
        except ValidationError as exc:
            raise RuntimeError(f"KVPool {pool_name!r} cannot be read: {exc.errors()[:1]}") from None
        names = pdd_mod.DeploymentNames(name)
        rev = old_status.get("revision")
        live = {r: self.state.cached_child("Deployment", ns, names.role(r)) for r in ALL_ROLES}
        hold, released = self.rollout.holds(key, pdd=pdd, live=live)
        if released:
            full = True  # prefill finished rolling to the new namespace: decode may follow now
        if full:
            try:
                desired = pdd_mod.build(pdd, pool, image=self.settings.image, hold=hold,
                                        policy=self.settings.pool_policy)
            except PolicyError as exc:
                await self.status.refuse(key, body=body, exc=exc)
                return "refused"
            # The pods' ServiceAccount first: a pod naming a missing one is refused at admission.
            await self.applier.apply_all(body, [(m, pdd_mod.access_labels(pdd)) for m in desired.access])
            results = await self.applier.apply_all(
                body, [(m, pdd_mod.labels_for(pdd, role)) for role, m in desired.applied], concurrent=True)
            self.state.cache_applied(r.obj for r in results)
            if not pdd.spec.router.enabled:
                await self._remove_router(ns, desired.router_names)
            self._record_changes(body, pdd, live, old_rev=rev, new_rev=desired.revision)
            rev = desired.revision
            self.state.mark_applied(key)
        workloads = {r: self.state.cached_child("Deployment", ns, names.role(r)) for r in ALL_ROLES}
        if not pdd.spec.router.enabled:
            workloads[Role.ROUTER] = None
        self.rollout.remember(key, hold)
        status = pdd_mod.status(pdd, pool=pool, workloads=workloads, revision=rev, existing=old_status,
                                generation=generation, held=tuple(hold))
        self.rollout.retire_namespace(body, pdd, old=old_status, status=status, workloads=workloads)
        await self.rollout.flush_retired(body, pool_body=pool_body, status=status)
        await self.status.write(key, body=stored, status=status)
        return "success"

    def _with_scale(self, ns: str, name: str, body: Manifest) -> Manifest:
        """The body as the planner wants it: pending decisions (and, after a status loss, the live replicas)
        written into status.<role>.desiredReplicas, with status.lastScale and an Event per decision."""
        spec = body.get("spec") or {}
        pending = self.pending_scales.pop((ns, name), {})
        if not (spec.get("autoscaling") or {}).get("enabled"):
            return body
        body = copy.deepcopy(body)
        status = body.setdefault("status", {})
        names = pdd_mod.DeploymentNames(name)
        for role in pdd_mod.ENGINE_ROLES:
            role_status = status.setdefault(role.value, {})
            decision = pending.get(role.value)
            if decision is not None:
                role_status["desiredReplicas"] = decision.desired
                status["lastScale"] = last_scale(decision, when=datetime.now(UTC).replace(microsecond=0))
                self.events.record(body, reason="Autoscaled",
                                   message=f"{role.value} {decision.current} -> {decision.desired}: {decision.reason}")
            elif role_status.get("desiredReplicas") is None:
                # Status lost or autoscaling just enabled: keep what runs rather than jump back to spec replicas.
                live = self.state.cached_child("Deployment", ns, names.role(role))
                if live is not None and (live.get("spec") or {}).get("replicas") is not None:
                    role_status["desiredReplicas"] = int(live["spec"]["replicas"])
        return body

    async def _remove_router(self, ns: str, names: tuple[str, str]) -> None:
        deployment, service = names
        self.applier.check_leader()
        if await self.client.delete(DEPLOYMENT, deployment, namespace=ns):
            logger.info("deleted router Deployment (router disabled) namespace=%s name=%s", ns, deployment)
        self.state.children.pop(("Deployment", ns, deployment), None)
        await self.client.delete(SERVICE, service, namespace=ns)

    def _record_changes(self, body: Manifest, pdd: PDDeployment, before: dict[Role, Manifest | None], *,
                        old_rev: str | None, new_rev: str) -> None:
        meta = body["metadata"]
        for role in ALL_ROLES:
            # role_replicas: the planner's decision while autoscaling is on, as the Deployment got it
            desired = ((pdd.spec.router.replicas if pdd.spec.router.enabled else 0) if role == Role.ROUTER
                       else pdd_mod.role_replicas(pdd, role))
            metrics.ROLE_REPLICAS.labels(namespace=meta["namespace"], deployment=meta["name"],
                                         role=role.value).set(desired)
        for role in ALL_ROLES:
            prev = before.get(role)
            if prev is None:
                continue
            was = int((prev.get("spec") or {}).get("replicas") or 0)
            now = pdd.spec.router.replicas if role == Role.ROUTER else pdd_mod.role_replicas(pdd, role)
            if role == Role.ROUTER and not pdd.spec.router.enabled:
                continue
            if was != now:
                self.events.record(body, reason="Scaled", message=f"scaled {role.value} from {was} to {now}")
                metrics.SCALE_EVENTS.labels(namespace=meta["namespace"], deployment=meta["name"],
                                            role=role.value, direction="up" if now > was else "down").inc()
        if old_rev and old_rev != new_rev:
            self.events.record(body, reason="RolloutStarted",
                               message=f"rolling out revision {new_rev} (was {old_rev}); "
                                       f"kvNamespace {pdd.spec.kv_namespace()}")


def last_scale(decision: Decision, *, when: datetime) -> dict[str, Any]:
    """status.lastScale for a decision, through the API model (wire names; numbers rounded: status is for people)."""
    return LastScale(time=when, role=Role(decision.role), from_replicas=decision.current, to_replicas=decision.desired,
                     reason=decision.reason[:1024],
                     numbers={k: round(v, 6) for k, v in decision.numbers.items()}).to_dict()
