"""Reconciles one KVPool: its agent DaemonSet and companions, the agents' binding, the token Secret, its status.

One reconciler per kind, as kubebuilder's ``internal/controller/<kind>_controller.go``:
the term's workers hand it KVPool keys only. A FULL reconcile builds the
children (``pool.build``, pure) and applies them through the shared
``Applier``; every reconcile then recomputes status from the DaemonSet, the
agent pods and their KVNode reports. A change of the pool's conditions queues
its PDDeployments (their Degraded condition follows the pool's).
"""

from __future__ import annotations

import logging

from pydantic import ValidationError

from daybreak.api.kvpool import KVPool
from daybreak.operator import pool as pool_mod
from daybreak.operator.agent_binding import AgentBinding
from daybreak.operator.children import Applier
from daybreak.operator.conditions import FALSE, Condition, merge
from daybreak.operator.kube import DAEMONSET, KVNODE, KVPOOL, POD, SECRET, KubeClient, KubeError, Manifest
from daybreak.operator.pool_policy import PolicyError, pool_violations
from daybreak.operator.settings import OperatorSettings
from daybreak.operator.state import POOL, Key, TermState
from daybreak.operator.status_writer import StatusWriter

logger = logging.getLogger(__name__)


class PoolReconciler:
    """Makes one KVPool's desired state true; returns the result label of the reconcile metric."""

    def __init__(self, client: KubeClient, state: TermState, *, settings: OperatorSettings, applier: Applier,
                 status: StatusWriter, binding: AgentBinding) -> None:
        self.client = client
        self.state = state
        self.settings = settings
        self.applier = applier
        self.status = status
        self.binding = binding

    async def reconcile(self, ns: str, name: str, *, full: bool) -> str:
        key: Key = (POOL, ns, name)
        body = await self.client.get_or_none(KVPOOL, name, namespace=ns)
        if body is None:
            await self.binding.unbind(ns, pool_mod.PoolNames(name, ns).service_account)
            self.state.applied.discard(key)
            return "gone"
        self.state.cache_parent(key, body)
        try:
            pool = KVPool.from_body(body)
        except ValidationError as exc:
            await self.status.invalid(key, body=body, exc=exc)
            return "invalid"
        violations = pool_violations(pool, self.settings.pool_policy)
        if violations:
            # Nothing is applied: what exists keeps running (no data loss) until the pool is fixed.
            await self.status.refuse(key, body=body, exc=PolicyError(violations))
            return "refused"
        generation = body["metadata"].get("generation")
        problems: list[Condition] = []
        if full:
            try:
                problems = await self._apply(key, body, pool)
            except pool_mod.AgentConfigError as exc:
                # Nothing is applied: the agents keep their last good config rather than crash-loop on this one.
                logger.error("agent config refused namespace=%s name=%s fields=%s error=%s", ns, name,
                             ",".join(exc.fields), exc)
                problems = [Condition(type="Ready", status=FALSE, reason="AgentConfigInvalid",
                                      message=str(exc)[:1000])]
        names = pool_mod.PoolNames(name, ns)
        ds = self.state.cached_child("DaemonSet", ns, names.agent)
        if ds is None:
            ds = await self.client.get_or_none(DAEMONSET, names.agent, namespace=ns)
        selector = ",".join(f"{k}={v}" for k, v in pool_mod.selector_for(pool).items())
        pods = await self.client.list(POD, namespace=ns, label_selector=selector)
        old_status = body.get("status") or {}
        status = pool_mod.status(pool, daemonset=ds, pods=pods, reports=await self._agent_reports(pods),
                                 existing=old_status, generation=generation)
        if problems:
            status["conditions"] = merge(status["conditions"], problems, generation=generation)
        old_ready = {c.get("type"): (c.get("status"), c.get("reason")) for c in old_status.get("conditions") or []}
        new_ready = {c.get("type"): (c.get("status"), c.get("reason")) for c in status["conditions"]}
        await self.status.write(key, body=body, status=status)
        if old_ready != new_ready:
            self.state.touch_dependents(ns, name, full=False)  # their Degraded condition follows the pool's
        return "success"

    async def _apply(self, key: Key, body: Manifest, pool: KVPool) -> list[Condition]:
        """Apply every child of the pool; the conditions it could not make true (a missing Secret)."""
        ns, name = key[1], key[2]
        problems: list[Condition] = []
        desired = pool_mod.build(pool, image=self.settings.image, policy=self.settings.pool_policy)
        labels = pool_mod.labels_for(pool)
        if desired.token_secret is not None:
            # A POST per full reconcile (409 once it exists): the operator cannot watch Secrets, and a
            # deleted token must come back (that is how a pool's token is rotated).
            await self.applier.create_once(body, desired.token_secret, labels=labels)
        else:
            secret = pool_mod.token_secret_name(pool)
            if not await self._secret_exists(ns, secret):
                problems.append(Condition(type="Ready", status=FALSE, reason="SecretNotFound",
                    message=f"spec.auth.secretRef names Secret {secret!r}, which does not exist; create it with a key "
                            f"{pool_mod.TOKEN_KEY!r} (agents cannot start without it)"))
        results = await self.applier.apply_all(body, [(m, labels) for m in desired.applied])
        self.state.cache_applied(r.obj for r in results)
        await self.binding.bind(ns, pool_mod.PoolNames(name, ns).service_account)
        self.state.mark_applied(key)
        return problems

    async def _agent_reports(self, pods: list[Manifest]) -> list[pool_mod.AgentReport]:
        """Capacity and use per tier from the KVNode of every node that runs one of the pool's agents."""
        nodes = {(p.get("spec") or {}).get("nodeName") for p in pods} - {None, ""}
        if not nodes:
            return []
        try:
            kvnodes = await self.client.list(KVNODE)
        except KubeError as exc:
            if exc.status in (403, 404):  # KVNode CRD not installed or not readable: fall back to the spec
                logger.debug("KVNode reports unavailable status=%s", exc.status)
                return []
            raise
        reports = (pool_mod.AgentReport.from_kvnode(k) for k in kvnodes)
        return [r for r in reports if r is not None and r.node in nodes]

    async def _secret_exists(self, ns: str, name: str) -> bool:
        """Whether Secret ``name`` exists, without the right to read Secrets: a server-side dry-run create
        answers 409 AlreadyExists for an existing name and stores nothing otherwise (docs/security.md)."""
        probe = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": name}, "type": "Opaque"}
        try:
            await self.client.create(SECRET, probe, namespace=ns, dry_run=True)
        except KubeError as exc:
            if exc.conflict:
                return True
            raise
        return False
