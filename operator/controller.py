"""The reconcile loop: watch events feed a work queue; workers build, apply and observe each object.

Level-based on purpose. Every trigger (a watch event of a KVPool or a
PDDeployment, a change of one of their Deployments or DaemonSets, a pool that
appears or vanishes, the periodic re-sync) only queues the object's key; a
worker then makes the whole desired state true again from what is there now.
A lost event, a hand-deleted child or an apiserver outage therefore costs at
most one re-sync period. kopf provides the watches (with their reconnects and
back-off); its handlers here never touch the API themselves.

Two reconcile depths: a FULL reconcile re-applies every child (after a spec
change, a child deletion or edit, a pool change, and on every re-sync); a
STATUS refresh (after a child's status changed) only recomputes status from
the cached children. Our own status writes come back as watch events and are
recognised by their resourceVersion, so they trigger nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any, NewType

import kopf
from pydantic import ValidationError

from daybreak.api.kvpool import KVPool
from daybreak.api.pddeployment import PDDeployment, Role
from daybreak.operator import deployment as pdd_mod
from daybreak.operator import metrics
from daybreak.operator import pool as pool_mod
from daybreak.operator.autoscaler import Autoscaler, last_scale
from daybreak.operator.children import MANAGED_BY, MANAGER, Applier, NotLeader
from daybreak.operator.conditions import FALSE, TRUE, Condition, merge
from daybreak.operator.events import WARNING, EventRecorder
from daybreak.operator.kube import (
    CLUSTERROLEBINDING,
    DAEMONSET,
    DEPLOYMENT,
    KVNODE,
    KVPOOL,
    PDDEPLOYMENT,
    POD,
    SECRET,
    SERVICE,
    Credentials,
    KubeClient,
    KubeError,
    Manifest,
)
from daybreak.operator.planner import Decision
from daybreak.operator.policy import PolicyError, pool_violations
from daybreak.operator.settings import OperatorSettings

logger = logging.getLogger(__name__)

POOL = "KVPool"
PDD = "PDDeployment"
Namespace = NewType("Namespace", str)
Key = tuple[str, str, str]  # (kind, namespace, name)


def _slim(obj: Manifest) -> Manifest:
    """A cached child without other managers' managedFields (memory: hundreds of children are cached)."""
    meta = dict(obj.get("metadata") or {})
    meta["managedFields"] = [m for m in meta.get("managedFields") or []
                             if m.get("manager") == MANAGER and m.get("operation") == "Apply"]
    return {"apiVersion": obj.get("apiVersion"), "kind": obj.get("kind"), "metadata": meta,
            "spec": obj.get("spec") or {}, "status": obj.get("status") or {}}


def _controller_owner(obj: Manifest) -> tuple[str, str] | None:
    for ref in (obj.get("metadata") or {}).get("ownerReferences") or []:
        if ref.get("controller") and ref.get("apiVersion", "").startswith("daybreak.dev/"):
            return str(ref.get("kind")), str(ref.get("name"))
    return None


class Controller:
    """One leadership term's reconciler: caches, queue, workers. Build a fresh one per term."""

    def __init__(self, client: KubeClient, settings: OperatorSettings, *, fence: Callable[[], bool]) -> None:
        self.client = client
        self.settings = settings
        self.events = EventRecorder(client)
        self.applier = Applier(client, events=self.events, fence=fence, cache=self._cached_child)
        self.queue: Any = None  # created in start(): it needs the running loop
        self.pools: dict[tuple[str, str], Manifest] = {}
        # Latest PDDeployment bodies from the watch (and our own status writes): a reconcile reads no GET.
        self.pdds: dict[tuple[str, str], Manifest] = {}
        self.children: dict[tuple[str, str, str], Manifest] = {}
        self.needs_apply: set[Key] = set()
        self.applied: set[Key] = set()
        self.own_status_rv: dict[Key, str] = {}
        self.generations: dict[Key, int] = {}
        self.pool_of: dict[tuple[str, str], str] = {}  # (ns, pdd) -> pool
        self.last_reconciled: dict[Key, float] = {}  # monotonic time of the last successful full reconcile
        # Subjects of the shared agent ClusterRoleBinding known to be there; one writer at a time.
        self.bound_agents: set[tuple[str, str]] = set()
        self._binding_lock = asyncio.Lock()
        # Planner decisions waiting for the object's next reconcile (which writes status and applies them).
        self.pending_scales: dict[tuple[str, str], dict[str, Decision]] = {}
        self.holding: set[Key] = set()  # deployments whose decode waits for prefill's rollout
        self.autoscaler = Autoscaler(self)
        self._tasks: list[asyncio.Task[Any]] = []

    # -- lifecycle --------------------------------------------------------------------------
    def start(self) -> None:
        """Spawn workers, the re-sync loop and the event poster (before kopf starts: see main)."""
        from daybreak.operator.workqueue import WorkQueue

        self.queue = WorkQueue[Key](max_delay=self.settings.max_backoff_seconds)
        for i in range(self.settings.workers):
            self._tasks.append(asyncio.create_task(self._worker(), name=f"daybreak worker {i}"))
        self._tasks.append(asyncio.create_task(self._resync_loop(), name="daybreak resync"))
        self._tasks.append(asyncio.create_task(self.events.run(), name="daybreak events"))
        self._tasks.append(asyncio.create_task(self.autoscaler.run(), name="daybreak planner"))

    async def stop(self) -> None:
        if self.queue is not None:
            self.queue.shutdown()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()

    # -- kopf wiring ----------------------------------------------------------------------------
    def registry(self, credentials: Credentials) -> kopf.OperatorRegistry:
        """A kopf registry whose handlers only feed this controller's queue and caches."""
        registry = kopf.OperatorRegistry()

        @kopf.on.login(registry=registry)
        def _login(**kwargs: Any) -> kopf.ConnectionInfo | None:
            # A sync handler: kopf runs it in a thread, so reading the token file does not block the loop.
            token = credentials.token
            if credentials.token_path:
                with open(credentials.token_path) as f:  # the projected token rotates: read it at every login
                    token = f.read().strip()
            return kopf.ConnectionInfo(
                server=credentials.server, ca_path=credentials.ca_path, insecure=credentials.insecure,
                token=token, scheme="Bearer" if token else None,
                certificate_path=credentials.certificate_path, private_key_path=credentials.private_key_path,
                default_namespace=credentials.default_namespace,
            )

        @kopf.on.event(KVPOOL.group, KVPOOL.version, KVPOOL.plural, registry=registry)
        async def _pool(event: kopf.RawEvent, **_: Any) -> None:
            self.on_pool_event(event.get("type"), dict(event["object"]))

        @kopf.on.event(PDDEPLOYMENT.group, PDDEPLOYMENT.version, PDDEPLOYMENT.plural, registry=registry)
        async def _pdd(event: kopf.RawEvent, **_: Any) -> None:
            self.on_pdd_event(event.get("type"), dict(event["object"]))

        # kopf filters labels client-side; these watches are the namespace's Deployments/DaemonSets.
        @kopf.on.event(DEPLOYMENT.group, DEPLOYMENT.version, DEPLOYMENT.plural, registry=registry,
                       labels={MANAGED_BY: MANAGER})
        async def _deployment(event: kopf.RawEvent, **_: Any) -> None:
            self.on_child_event(event.get("type"), dict(event["object"]))

        @kopf.on.event(DAEMONSET.group, DAEMONSET.version, DAEMONSET.plural, registry=registry,
                       labels={MANAGED_BY: MANAGER})
        async def _daemonset(event: kopf.RawEvent, **_: Any) -> None:
            self.on_child_event(event.get("type"), dict(event["object"]))

        return registry

    # -- event intake (synchronous, cheap: the watch must never wait) ----------------------------
    def _in_scope(self, namespace: str) -> bool:
        return not self.settings.namespaces or namespace in self.settings.namespaces

    def on_pool_event(self, type_: str | None, obj: Manifest) -> None:
        meta = obj.get("metadata") or {}
        ns, name = meta.get("namespace", ""), meta.get("name", "")
        if not self._in_scope(ns):
            return
        key: Key = (POOL, ns, name)
        if type_ == "DELETED":
            self.pools.pop((ns, name), None)
            self.needs_apply.add(key)
            self.queue.add(key)
            self._touch_dependents(ns, name, full=True)
            return
        known = (ns, name) in self.pools
        self.pools[(ns, name)] = obj
        if meta.get("resourceVersion") == self.own_status_rv.get(key):
            return  # the echo of our own status write
        generation = int(meta.get("generation") or 0)
        if self.generations.get(key) != generation or not known:
            self.generations[key] = generation
            self.needs_apply.add(key)
            self._touch_dependents(ns, name, full=True)
        self.queue.add(key)

    def on_pdd_event(self, type_: str | None, obj: Manifest) -> None:
        meta = obj.get("metadata") or {}
        ns, name = meta.get("namespace", ""), meta.get("name", "")
        if not self._in_scope(ns):
            return
        key: Key = (PDD, ns, name)
        if type_ == "DELETED":
            self.pool_of.pop((ns, name), None)
            self.pdds.pop((ns, name), None)
            for cache in (self.generations, self.own_status_rv, self.last_reconciled):
                cache.pop(key, None)
            self.applied.discard(key)
            for role in (*pdd_mod.ENGINE_ROLES, Role.ROUTER):  # no stale series for a deleted deployment
                with contextlib.suppress(KeyError):
                    metrics.ROLE_REPLICAS.remove(ns, name, role.value)
            return  # the garbage collector removes the children (owner references)
        self.pool_of[(ns, name)] = str(((obj.get("spec") or {}).get("poolRef") or {}).get("name", ""))
        self.pdds[(ns, name)] = obj
        if meta.get("resourceVersion") == self.own_status_rv.get(key):
            return
        generation = int(meta.get("generation") or 0)
        if self.generations.get(key) != generation:
            self.generations[key] = generation
            self.needs_apply.add(key)
            self.queue.add(key)

    def on_child_event(self, type_: str | None, obj: Manifest) -> None:
        meta = obj.get("metadata") or {}
        ns, name = meta.get("namespace", ""), meta.get("name", "")
        owner = _controller_owner(obj)
        if owner is None or not self._in_scope(ns):
            return
        kind = str(obj.get("kind") or ("DaemonSet" if owner[0] == POOL else "Deployment"))
        ckey = (kind, ns, name)
        parent: Key = (owner[0], ns, owner[1])
        if type_ == "DELETED":
            self.children.pop(ckey, None)
            self.needs_apply.add(parent)  # drift: put it back now, not at the next re-sync
            self.queue.add(parent)
            return
        old = self.children.get(ckey)
        self.children[ckey] = _slim(obj)
        if old is not None and (old.get("metadata") or {}).get("generation") != meta.get("generation"):
            self.needs_apply.add(parent)  # its spec changed: maybe a hand edit, re-assert ours
        self.queue.add(parent)

    def _touch_dependents(self, ns: str, pool: str, *, full: bool) -> None:
        for (dns, dname), pname in list(self.pool_of.items()):
            if dns == ns and pname == pool:
                key: Key = (PDD, dns, dname)
                if full:
                    self.needs_apply.add(key)
                self.queue.add(key)

    def _cached_child(self, kind: str, ns: str | None, name: str) -> Manifest | None:
        return self.children.get((kind, ns or "", name))

    # -- workers ----------------------------------------------------------------------------------
    async def _worker(self) -> None:
        while True:
            key = await self.queue.get()
            try:
                await self.reconcile(key)
            finally:
                self.queue.done(key)

    async def reconcile(self, key: Key) -> None:
        kind, ns, name = key
        full = key in self.needs_apply or key not in self.applied
        self.needs_apply.discard(key)
        started = time.monotonic()
        result = "success"
        try:
            if kind == POOL:
                result = await self.reconcile_pool(ns, name, full=full)
            else:
                result = await self.reconcile_pdd(ns, name, full=full)
            self.queue.forget(key)
        except NotLeader:
            result = "not_leader"
            logger.warning("reconcile skipped: not the leader kind=%s namespace=%s name=%s", kind, ns, name)
        except KubeError as exc:
            result = "error"
            if full:
                self.needs_apply.add(key)
            delay = self.queue.add_rate_limited(key)
            metrics.API_ERRORS.labels(status=str(exc.status)).inc()
            logger.warning("reconcile failed kind=%s namespace=%s name=%s status=%s error=%r retry_in=%.1fs",
                           kind, ns, name, exc.status, exc.message or exc.reason, delay)
            if not exc.retriable:
                await self._report_failure(key, f"{exc.method} {exc.path}: {exc.status} {exc.message}")
        except Exception as exc:  # a bug or an unexpected object: keep the other objects going
            result = "error"
            if full:
                self.needs_apply.add(key)
            delay = self.queue.add_rate_limited(key)
            logger.exception("reconcile crashed kind=%s namespace=%s name=%s retry_in=%.1fs",
                             kind, ns, name, delay)
            await self._report_failure(key, f"{type(exc).__name__}: {exc}")
        finally:
            metrics.RECONCILES.labels(kind=kind, result=result).inc()
            metrics.RECONCILE_DURATION.labels(kind=kind).observe(time.monotonic() - started)

    async def _report_failure(self, key: Key, message: str) -> None:
        """Best effort: put the failure where users look (a condition and an Event)."""
        kind, ns, name = key
        rk = KVPOOL if kind == POOL else PDDEPLOYMENT
        try:
            self.applier.check_leader()
            body = await self.client.get(rk, name, namespace=ns)
            status = dict(body.get("status") or {})
            status["conditions"] = merge(status.get("conditions"), [
                Condition(type="Ready", status=FALSE, reason="ReconcileFailed", message=message[:1000]),
                Condition(type="Degraded", status=TRUE, reason="ReconcileFailed", message=message[:1000]),
            ], generation=(body.get("metadata") or {}).get("generation"))
            await self._write_status(key, rk, body, status)
            self.events.record(body, reason="ReconcileFailed", message=message, type=WARNING)
        except (KubeError, NotLeader) as exc:
            logger.debug("could not report failure kind=%s name=%s error=%s", kind, name, exc)

    async def _write_status(self, key: Key, rk: Any, body: Manifest, status: dict[str, Any]) -> Manifest:
        if status == (body.get("status") or {}):
            return body
        self.applier.check_leader()
        meta = body["metadata"]
        updated = await self.client.patch_merge(rk, meta["name"], {"status": status}, namespace=meta["namespace"],
                                                subresource="status")
        rv = (updated.get("metadata") or {}).get("resourceVersion")
        if rv:
            self.own_status_rv[key] = rv
        cache = self.pdds if key[0] == PDD else self.pools
        cache[(key[1], key[2])] = updated
        return updated

    # -- KVPool -------------------------------------------------------------------------------------
    async def reconcile_pool(self, ns: str, name: str, *, full: bool) -> str:
        key: Key = (POOL, ns, name)
        body = await self.client.get_or_none(KVPOOL, name, namespace=ns)
        if body is None:
            await self._unbind_agent(ns, pool_mod.PoolNames(name, ns).service_account)
            self.applied.discard(key)
            return "gone"
        self.pools[(ns, name)] = body
        try:
            pool = KVPool.from_body(body)
        except ValidationError as exc:
            await self._invalid(key, KVPOOL, body, exc)
            return "invalid"
        violations = pool_violations(pool, self.settings.pool_policy)
        if violations:
            # Nothing is applied: what exists keeps running (no data loss) until the pool is fixed.
            await self._refuse(key, KVPOOL, body, PolicyError(violations))
            return "refused"
        generation = body["metadata"].get("generation")
        problems: list[Condition] = []
        if full:
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
            for result in await self.applier.apply_all(body, [(m, labels) for m in desired.applied]):
                if result.obj.get("kind") == "DaemonSet":
                    self.children[("DaemonSet", ns, result.obj["metadata"]["name"])] = _slim(result.obj)
            await self._bind_agent(ns, pool_mod.PoolNames(name, ns).service_account)
            self.applied.add(key)
            self.last_reconciled[key] = time.monotonic()
        names = pool_mod.PoolNames(name, ns)
        ds = self.children.get(("DaemonSet", ns, names.agent))
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
        await self._write_status(key, KVPOOL, body, status)
        if old_ready != new_ready:
            self._touch_dependents(ns, name, full=False)  # their Degraded condition follows the pool's
        return "success"

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

    # -- the shared agent ClusterRoleBinding -----------------------------------------------------
    # Agents need Node and KVNode rights (cluster-scoped). Instead of one ClusterRoleBinding per pool, which
    # would need create and delete on every ClusterRoleBinding (cluster-admin's included), the chart ships
    # one, daybreak-agents, and the operator only edits its subjects: get/update by resourceName.
    async def _edit_agent_binding(self, change: Callable[[list[dict[str, Any]]], list[dict[str, Any]]]) -> None:
        async with self._binding_lock:
            for _ in range(5):
                self.applier.check_leader()
                binding = await self.client.get_or_none(CLUSTERROLEBINDING, pool_mod.AGENT_BINDING)
                if binding is None:
                    binding = pool_mod.agent_binding([])
                    subjects = change([])
                    binding["subjects"] = subjects
                    try:
                        await self.client.create(CLUSTERROLEBINDING, binding)
                    except KubeError as exc:
                        if exc.conflict:
                            continue
                        raise
                else:
                    old = list(binding.get("subjects") or [])
                    subjects = change(old)
                    if subjects == old:
                        self._remember_bound(subjects)
                        return
                    binding["subjects"] = subjects
                    try:
                        await self.client.replace(CLUSTERROLEBINDING, binding)  # resourceVersion: no lost update
                    except KubeError as exc:
                        if exc.conflict:
                            continue
                        raise
                self._remember_bound(subjects)
                return
            raise KubeError(status=409, reason="Conflict", message="the agent ClusterRoleBinding kept changing",
                            method="PUT", path=pool_mod.AGENT_BINDING)

    def _remember_bound(self, subjects: list[dict[str, Any]]) -> None:
        self.bound_agents = {(str(s.get("namespace")), str(s.get("name"))) for s in subjects
                             if s.get("kind") == "ServiceAccount"}

    async def _bind_agent(self, ns: str, service_account: str) -> None:
        if (ns, service_account) in self.bound_agents:
            return
        subject = pool_mod.agent_subject(ns, service_account)
        await self._edit_agent_binding(lambda old: sorted([*[s for s in old if s != subject], subject],
                                                          key=pool_mod.subject_key))
        logger.info("bound agent ServiceAccount namespace=%s name=%s binding=%s", ns, service_account,
                    pool_mod.AGENT_BINDING)

    async def _unbind_agent(self, ns: str, service_account: str) -> None:
        subject = pool_mod.agent_subject(ns, service_account)
        await self._edit_agent_binding(lambda old: [s for s in old if s != subject])
        self.bound_agents.discard((ns, service_account))

    async def sweep_agent_binding(self, live_pools: set[tuple[str, str]]) -> None:
        """Drop the subjects of pools that are gone (a binding subject cannot carry an owner reference)."""
        live = {pool_mod.subject_key(pool_mod.agent_subject(ns, pool_mod.PoolNames(p, ns).service_account))
                for ns, p in live_pools}

        def keep(subject: dict[str, Any]) -> bool:
            ours = (subject.get("kind") == "ServiceAccount"
                    and str(subject.get("name", "")).endswith(pool_mod.AGENT_SA_SUFFIX)
                    and self._in_scope(str(subject.get("namespace", ""))))
            return not ours or pool_mod.subject_key(subject) in live

        await self._edit_agent_binding(lambda old: [s for s in old if keep(s)])

    # -- PDDeployment ------------------------------------------------------------------------------
    def submit_scale(self, ns: str, name: str, decisions: list[Decision]) -> None:
        """Hand planner decisions to the object's reconcile (one worker per key: no status write races)."""
        pending = self.pending_scales.setdefault((ns, name), {})
        for d in decisions:
            pending[d.role] = d
        key: Key = (PDD, ns, name)
        self.needs_apply.add(key)
        self.queue.add(key)

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
                live = self.children.get(("Deployment", ns, names.role(role)))
                if live is not None and (live.get("spec") or {}).get("replicas") is not None:
                    role_status["desiredReplicas"] = int(live["spec"]["replicas"])
        return body

    async def reconcile_pdd(self, ns: str, name: str, *, full: bool) -> str:
        key: Key = (PDD, ns, name)
        body = self.pdds.get((ns, name))
        if body is None:
            body = await self.client.get_or_none(PDDEPLOYMENT, name, namespace=ns)
        if body is None:
            self.applied.discard(key)
            return "gone"
        stored = body  # what the API holds: status writes compare against it, not the planner's edit
        body = self._with_scale(ns, name, body)
        try:
            pdd = PDDeployment.from_body(body)
        except ValidationError as exc:
            await self._invalid(key, PDDEPLOYMENT, body, exc)
            return "invalid"
        generation = body["metadata"].get("generation")
        pool_name = pdd.spec.pool_ref.name
        self.pool_of[(ns, name)] = pool_name
        pool_body = self.pools.get((ns, pool_name))
        if pool_body is None:
            pool_body = await self.client.get_or_none(KVPOOL, pool_name, namespace=ns)
            if pool_body is not None:
                self.pools[(ns, pool_name)] = pool_body
        old_status = body.get("status") or {}
        if pool_body is None:
            status = pdd_mod.status(pdd, pool=None, workloads={}, revision=None, existing=old_status,
                                    generation=generation)
            was: dict[str, Any] = next(
                (c for c in old_status.get("conditions") or [] if c.get("type") == "Ready"), {})
            if was.get("reason") != "PoolNotFound":
                self.events.record(body, reason="PoolNotFound", type=WARNING,
                                   message=f"KVPool {pool_name!r} not found in namespace {ns!r}; waiting for it")
            await self._write_status(key, PDDEPLOYMENT, stored, status)
            self.needs_apply.add(key)  # apply everything once the pool shows up
            return "waiting"
        try:
            pool = KVPool.from_body(pool_body)
        except ValidationError as exc:
            raise RuntimeError(f"KVPool {pool_name!r} cannot be read: {exc.errors()[:1]}") from None
        names = pdd_mod.DeploymentNames(name)
        roles = (*pdd_mod.ENGINE_ROLES, Role.ROUTER)
        rev = old_status.get("revision")
        live = {r: self.children.get(("Deployment", ns, names.role(r))) for r in roles}
        hold = pdd_mod.rollout_holds(pdd, live)
        if not hold and key in self.holding:
            full = True  # prefill finished rolling to the new namespace: decode may follow now
        if full:
            try:
                desired = pdd_mod.build(pdd, pool, image=self.settings.image, hold=hold,
                                        policy=self.settings.pool_policy)
            except PolicyError as exc:
                await self._refuse(key, PDDEPLOYMENT, body, exc)
                return "refused"
            before = live
            # The pods' ServiceAccount first: a pod naming a missing one is refused at admission.
            await self.applier.apply_all(body, [(m, pdd_mod.access_labels(pdd)) for m in desired.access])
            results = await self.applier.apply_all(
                body, [(m, pdd_mod.labels_for(pdd, role)) for role, m in desired.applied], concurrent=True)
            for result in results:
                if result.obj.get("kind") == "Deployment":
                    meta = result.obj["metadata"]
                    self.children[("Deployment", ns, meta["name"])] = _slim(result.obj)
            if not pdd.spec.router.enabled:
                await self._remove_router(ns, desired.router_names)
            self._record_changes(body, pdd, before, old_rev=rev, new_rev=desired.revision)
            rev = desired.revision
            self.applied.add(key)
            self.last_reconciled[key] = time.monotonic()
        workloads = {r: self.children.get(("Deployment", ns, names.role(r))) for r in roles}
        if not pdd.spec.router.enabled:
            workloads[Role.ROUTER] = None
        if hold:
            self.holding.add(key)
        else:
            self.holding.discard(key)
        status = pdd_mod.status(pdd, pool=pool, workloads=workloads, revision=rev, existing=old_status,
                                generation=generation, held=tuple(hold))
        self._retire_namespace(body, pdd, old_status, status, workloads)
        await self._flush_retired(body, pool_body, status)
        await self._write_status(key, PDDEPLOYMENT, stored, status)
        return "success"

    def _retire_namespace(self, body: Manifest, pdd: PDDeployment, old: dict[str, Any], status: dict[str, Any],
                          workloads: dict[Role, Manifest | None]) -> None:
        """Track the previous kvNamespace through a rollout; once no engine uses it, retire it per
        updateStrategy.cache (and say so in status and an Event)."""
        now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        new_ns = pdd.spec.kv_namespace()
        policy = pdd.spec.update_strategy.cache.value
        was = old.get("kvNamespace")
        retiring = old.get("retiringKVNamespace")
        if was and was != new_ns:
            if retiring and retiring.get("kvNamespace") != new_ns:
                self.events.record(body, reason="KVNamespaceSuperseded",
                                   message=f"kvNamespace {retiring.get('kvNamespace')} replaced again before its "
                                           f"rollout finished; retiring {was} as well when {new_ns} is rolled out")
            status["retiringKVNamespace"] = {"kvNamespace": was, "policy": policy, "since": now}
            self.events.record(body, reason="KVNamespaceChanged",
                               message=f"kvNamespace {was} -> {new_ns}: prefill rolls first, decode follows; "
                                       f"each engine reads only its own namespace's blocks")
            return
        if not retiring or not pdd_mod.rolled_out(pdd, workloads):
            return
        old_ns = str(retiring.get("kvNamespace"))
        if policy == "flush":
            # The operator holds no store credential: the agents flush (see _flush_retired).
            message = f"{old_ns} retired; flush requested from the pool's agents (KVPool status.flushRequests)"
            self.events.record(body, reason="KVNamespaceFlushRequested", message=message)
        else:
            message = f"{old_ns} retired; its blocks stay until the pool's watermarks evict them"
            self.events.record(body, reason="KVNamespaceRetired", message=message)
        status["retiredKVNamespace"] = {**retiring, "policy": policy, "retiredAt": now, "message": message}
        status["retiringKVNamespace"] = None

    async def _flush_retired(self, body: Manifest, pool_body: Manifest, status: dict[str, Any]) -> None:
        """updateStrategy.cache flush: ask the pool's agents through the KVPool status, then sum their KVNode reports.

        The request is (kvNamespace, retiredAt) in ``status.flushRequests`` of the KVPool; each agent flushes
        its own store in-process and lists what it freed in its KVNode's ``status.namespaceFlushes``. Once
        every agent of the pool (its endpoints) has answered, the sum goes to retiredKVNamespace.bytesFreed,
        an Event says so and the request leaves the KVPool. Until then each reconcile (or resync) looks again.
        """
        # A copy: ``status`` shares this dict with the cached body it is compared against before writing,
        # so editing it in place made the write look unnecessary and bytesFreed was never stored (the
        # request then went out again at every reconcile).
        retired = dict(status.get("retiredKVNamespace") or {})
        if retired.get("policy") != "flush" or retired.get("bytesFreed") is not None or not retired.get("retiredAt"):
            return
        try:
            await self._flush_step(body, pool_body, status, retired)
        except KubeError as exc:  # the deployment's own status still gets written; the next reconcile retries
            logger.warning("cache flush step failed kvNamespace=%s status=%s error=%s; retrying at the next "
                           "reconcile", retired.get("kvNamespace"), exc.status, exc)

    async def _flush_step(self, body: Manifest, pool_body: Manifest, status: dict[str, Any],
                          retired: dict[str, Any]) -> None:
        old_ns, at = str(retired.get("kvNamespace")), str(retired["retiredAt"])
        meta = body["metadata"]
        pool_meta = pool_body["metadata"]
        pool_status = pool_body.get("status") or {}
        requests = list(pool_status.get("flushRequests") or [])
        mine = {"kvNamespace": old_ns, "requestedAt": at}
        if not any(r.get("kvNamespace") == old_ns and r.get("requestedAt") == at for r in requests):
            self.applier.check_leader()
            entry = {**mine, "requestedBy": f"{meta['namespace']}/{meta['name']}"}
            updated = await self.client.patch_merge(KVPOOL, pool_meta["name"], {"status": {"flushRequests": [
                *requests, entry]}}, namespace=pool_meta["namespace"], subresource="status")
            self.pools[(pool_meta["namespace"], pool_meta["name"])] = updated
            logger.info("flush requested namespace=%s name=%s kvNamespace=%s pool=%s", meta["namespace"],
                        meta["name"], old_ns, pool_meta["name"])
            return
        nodes = {e.get("node") for e in pool_status.get("endpoints") or []} - {None, ""}
        freed: dict[str, int] = {}
        for kvnode in await self.client.list(KVNODE) if nodes else []:
            node = (kvnode.get("spec") or {}).get("nodeName") or (kvnode.get("metadata") or {}).get("name")
            for report in (kvnode.get("status") or {}).get("namespaceFlushes") or []:
                if node in nodes and report.get("kvNamespace") == old_ns and report.get("requestedAt") == at:
                    freed[str(node)] = int(report.get("bytesFreed") or 0)
        if set(freed) != nodes:
            return  # an agent has not answered yet
        total = sum(freed.values())
        retired["bytesFreed"] = total
        retired["message"] = f"{old_ns} flushed: {total} bytes freed on {len(nodes)} agents"
        status["retiredKVNamespace"] = retired
        metrics.CACHE_FLUSHED_BYTES.labels(namespace=meta["namespace"], deployment=meta["name"]).inc(total)
        self.events.record(body, reason="KVNamespaceFlushed", message=retired["message"])
        self.applier.check_leader()
        rest = [r for r in requests if not (r.get("kvNamespace") == old_ns and r.get("requestedAt") == at)]
        updated = await self.client.patch_merge(KVPOOL, pool_meta["name"], {"status": {"flushRequests": rest}},
                                                namespace=pool_meta["namespace"], subresource="status")
        self.pools[(pool_meta["namespace"], pool_meta["name"])] = updated

    async def _remove_router(self, ns: str, names: tuple[str, str]) -> None:
        deployment, service = names
        self.applier.check_leader()
        if await self.client.delete(DEPLOYMENT, deployment, namespace=ns):
            logger.info("deleted router Deployment (router disabled) namespace=%s name=%s", ns, deployment)
        self.children.pop(("Deployment", ns, deployment), None)
        await self.client.delete(SERVICE, service, namespace=ns)

    def _record_changes(self, body: Manifest, pdd: PDDeployment, before: dict[Role, Manifest | None], *,
                        old_rev: str | None, new_rev: str) -> None:
        meta = body["metadata"]
        for role in (*pdd_mod.ENGINE_ROLES, Role.ROUTER):
            # role_replicas: the planner's decision while autoscaling is on, as the Deployment got it
            desired = ((pdd.spec.router.replicas if pdd.spec.router.enabled else 0) if role == Role.ROUTER
                       else pdd_mod.role_replicas(pdd, role))
            metrics.ROLE_REPLICAS.labels(namespace=meta["namespace"], deployment=meta["name"],
                                         role=role.value).set(desired)
        for role in (*pdd_mod.ENGINE_ROLES, Role.ROUTER):
            prev = before.get(role)
            if prev is None:
                continue
            was = int((prev.get("spec") or {}).get("replicas") or 0)
            now = pdd.spec.router.replicas if role == Role.ROUTER else pdd_mod.role_replicas(pdd, role)
            if role == Role.ROUTER and not pdd.spec.router.enabled:
                continue
            if was != now:
                self.events.record(body, reason="Scaled", message=f"scaled {role.value} from {was} to {now}")
                metrics.SCALE_EVENTS.labels(namespace=body["metadata"]["namespace"], deployment=body["metadata"]["name"],
                                            role=role.value, direction="up" if now > was else "down").inc()
        if old_rev and old_rev != new_rev:
            self.events.record(body, reason="RolloutStarted",
                               message=f"rolling out revision {new_rev} (was {old_rev}); "
                                       f"kvNamespace {pdd.spec.kv_namespace()}")

    async def _refuse(self, key: Key, rk: Any, body: Manifest, exc: PolicyError) -> None:
        """The object asks for more than the pool policy allows: say which field, apply nothing."""
        message = str(exc)[:1000]
        status = dict(body.get("status") or {})
        status["conditions"] = merge(status.get("conditions"), [
            Condition(type="Ready", status=FALSE, reason="PolicyViolation", message=message),
        ], generation=(body.get("metadata") or {}).get("generation"))
        logger.warning("refused by pool policy kind=%s namespace=%s name=%s violations=%r", key[0], key[1], key[2],
                       message)
        was: dict[str, Any] = next(
            (c for c in (body.get("status") or {}).get("conditions") or [] if c.get("type") == "Ready"), {})
        if was.get("message") != message:
            self.events.record(body, reason="PolicyViolation", message=message, type=WARNING)
        await self._write_status(key, rk, body, status)

    async def _invalid(self, key: Key, rk: Any, body: Manifest, exc: ValidationError) -> None:
        errors = exc.errors()
        if errors:
            where = ".".join(str(p) for p in errors[0]["loc"])
            message = f"{where}: {errors[0]['msg']}"
        else:
            message = str(exc)
        status = dict(body.get("status") or {})
        status["conditions"] = merge(status.get("conditions"), [
            Condition(type="Ready", status=FALSE, reason="InvalidSpec", message=message),
        ], generation=(body.get("metadata") or {}).get("generation"))
        logger.warning("invalid object kind=%s namespace=%s name=%s error=%r", key[0], key[1], key[2], message)
        await self._write_status(key, rk, body, status)

    # -- re-sync ------------------------------------------------------------------------------------
    async def _resync_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.resync_seconds)
            try:
                await self.resync()
            except (KubeError, NotLeader) as exc:
                logger.warning("resync failed error=%s", exc)
            except Exception:  # a bug must not end the re-sync for the rest of the term
                logger.exception("resync crashed; retrying at the next period")

    async def _refresh_children(self, scopes: tuple[str | None, ...]) -> None:
        """Replace the cached Deployments/DaemonSets with a LIST: a watch event lost in a reconnect must not
        leave a deleted child in the cache (the applier skips children the cache says are untouched)."""
        for rk in (DEPLOYMENT, DAEMONSET):
            items = []
            for ns in scopes:
                items += await self.client.list(rk, namespace=ns, label_selector=f"{MANAGED_BY}={MANAGER}")
            fresh = {}
            for item in items:
                item.setdefault("apiVersion", rk.api_version)
                item.setdefault("kind", rk.kind)
                meta = item["metadata"]
                fresh[(rk.kind, meta["namespace"], meta["name"])] = _slim(item)
            for stale in [k for k in self.children if k[0] == rk.kind and k not in fresh]:
                del self.children[stale]
            # Possibly older than a concurrent watch event or apply: that only costs one extra apply.
            self.children.update(fresh)

    async def resync(self) -> None:
        """Queue a full reconcile of every object in scope and sweep the agent binding's stale subjects."""
        scopes: tuple[str | None, ...] = self.settings.namespaces or (None,)
        try:
            pools, pdds = [], []
            for ns in scopes:
                pools += await self.client.list(KVPOOL, namespace=ns)
                pdds += await self.client.list(PDDEPLOYMENT, namespace=ns)
        except KubeError:
            # Still re-assert what we know: each key then retries on its own back-off until the apiserver is back.
            known: list[Key] = [(POOL, n, p) for n, p in self.pools] + [(PDD, n, d) for n, d in self.pool_of]
            for known_key in known:
                if self.queue.failures(known_key) == 0:
                    self.needs_apply.add(known_key)
                    self.queue.add(known_key)
            raise
        await self._refresh_children(scopes)
        live: set[tuple[str, str]] = set()
        for kind, items in ((POOL, pools), (PDD, pdds)):
            for obj in items:
                meta = obj["metadata"]
                key: Key = (kind, meta["namespace"], meta["name"])
                if kind == POOL:
                    live.add((meta["namespace"], meta["name"]))
                else:
                    obj.setdefault("apiVersion", PDDEPLOYMENT.api_version)
                    obj.setdefault("kind", PDD)
                    self.pdds[(meta["namespace"], meta["name"])] = obj  # fresh from the LIST
                self.needs_apply.add(key)
                self.queue.add(key)
        await self.sweep_agent_binding(live)
        logger.debug("resync queued pools=%d pddeployments=%d", len(pools), len(pdds))
