"""One leadership term: the queue's workers dispatch each key to its kind's reconciler; the re-sync; the wiring.

Level-based on purpose. Every trigger (a watch event through ``kopf_adapter``,
a planner decision, the periodic re-sync here) only queues the object's key;
a worker then hands the key to its kind's reconciler (``pool_reconciler`` for
a KVPool, ``deployment_reconciler`` for a PDDeployment), which makes the whole
desired state true again from what is there now. A lost event, a hand-deleted
child or an apiserver outage therefore costs at most one re-sync period.

The workers own what both kinds share: the reconcile metrics, the back-off
of a failed key, and reporting a failure where users look. The planner loop
(``autoscaler``) gets only a ``submit_scale`` callable, never this object.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

import kopf

from daybreak.operator import kopf_adapter, metrics
from daybreak.operator.agent_binding import AgentBinding
from daybreak.operator.autoscaler import Autoscaler
from daybreak.operator.children import MANAGED_BY, MANAGER, Applier, NotLeader
from daybreak.operator.deployment_reconciler import DeploymentReconciler
from daybreak.operator.events import EventRecorder
from daybreak.operator.kube import (
    DAEMONSET,
    DEPLOYMENT,
    KVPOOL,
    PDDEPLOYMENT,
    Credentials,
    KubeClient,
    KubeError,
)
from daybreak.operator.pool_reconciler import PoolReconciler
from daybreak.operator.rollout import Rollout
from daybreak.operator.settings import OperatorSettings
from daybreak.operator.state import PDD, POOL, Key, TermState
from daybreak.operator.status_writer import StatusWriter

logger = logging.getLogger(__name__)


class Controller:
    """One leadership term's reconcilers, queue and workers. Build a fresh one per term."""

    def __init__(self, client: KubeClient, settings: OperatorSettings, *, fence: Callable[[], bool]) -> None:
        self.client = client
        self.settings = settings
        self.state = TermState(namespaces=settings.namespaces, max_backoff_seconds=settings.max_backoff_seconds)
        self.events = EventRecorder(client)
        self.applier = Applier(client, events=self.events, fence=fence, cache=self.state.cached_child)
        check_leader = self.applier.check_leader
        self.status = StatusWriter(client, self.state, events=self.events, check_leader=check_leader)
        self.binding = AgentBinding(client, check_leader=check_leader, in_scope=self.state.in_scope)
        self.rollout = Rollout(client, self.state, events=self.events, check_leader=check_leader)
        self.pool_reconciler = PoolReconciler(client, self.state, settings=settings, applier=self.applier,
                                              status=self.status, binding=self.binding)
        self.deployment_reconciler = DeploymentReconciler(
            client, self.state, settings=settings, applier=self.applier, events=self.events, status=self.status,
            rollout=self.rollout)
        self.intake = kopf_adapter.EventIntake(self.state, forget_deployment=self.deployment_reconciler.forget)
        self.autoscaler = Autoscaler(client, deployments=self.state.pdds, check_leader=check_leader,
                                     submit_scale=self.deployment_reconciler.submit_scale)
        self._tasks: list[asyncio.Task[Any]] = []

    # -- lifecycle --------------------------------------------------------------------------
    def start(self) -> None:
        """Spawn workers, the re-sync loop, the event poster and the planner (before kopf starts: see main)."""
        for i in range(self.settings.workers):
            self._tasks.append(asyncio.create_task(self._worker(), name=f"daybreak worker {i}"))
        self._tasks.append(asyncio.create_task(self._resync_loop(), name="daybreak resync"))
        self._tasks.append(asyncio.create_task(self.events.run(), name="daybreak events"))
        self._tasks.append(asyncio.create_task(self.autoscaler.run(), name="daybreak planner"))

    async def stop(self) -> None:
        self.state.queue.shutdown()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()

    def registry(self, credentials: Credentials) -> kopf.OperatorRegistry:
        """The kopf registry of this term: its watches only feed this term's caches and queue."""
        return kopf_adapter.registry(self.intake, credentials)

    # -- workers ----------------------------------------------------------------------------------
    async def _worker(self) -> None:
        queue = self.state.queue
        while True:
            key = await queue.get()
            try:
                await self.reconcile(key)
            finally:
                queue.done(key)

    async def reconcile(self, key: Key) -> None:
        """Reconcile ``key`` with its kind's reconciler; count it, and on failure back off and report."""
        state, queue = self.state, self.state.queue
        kind, ns, name = key
        full = key in state.needs_apply or key not in state.applied
        state.needs_apply.discard(key)
        started = time.monotonic()
        result = "success"
        try:
            if kind == POOL:
                result = await self.pool_reconciler.reconcile(ns, name, full=full)
            else:
                result = await self.deployment_reconciler.reconcile(ns, name, full=full)
            queue.forget(key)
        except NotLeader:
            result = "not_leader"
            logger.warning("reconcile skipped: not the leader kind=%s namespace=%s name=%s", kind, ns, name)
        except KubeError as exc:
            result = "error"
            if full:
                state.needs_apply.add(key)
            delay = queue.add_rate_limited(key)
            metrics.API_ERRORS.labels(status=str(exc.status)).inc()
            logger.warning("reconcile failed kind=%s namespace=%s name=%s status=%s error=%r retry_in=%.1fs",
                           kind, ns, name, exc.status, exc.message or exc.reason, delay)
            if not exc.retriable:
                await self.status.report_failure(key, f"{exc.method} {exc.path}: {exc.status} {exc.message}")
        except Exception as exc:  # a bug or an unexpected object: keep the other objects going
            result = "error"
            if full:
                state.needs_apply.add(key)
            delay = queue.add_rate_limited(key)
            logger.exception("reconcile crashed kind=%s namespace=%s name=%s retry_in=%.1fs",
                             kind, ns, name, delay)
            await self.status.report_failure(key, f"{type(exc).__name__}: {exc}")
        finally:
            metrics.RECONCILES.labels(kind=kind, result=result).inc()
            metrics.RECONCILE_DURATION.labels(kind=kind).observe(time.monotonic() - started)

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
        children = self.state.children
        for rk in (DEPLOYMENT, DAEMONSET):
            items = []
            for ns in scopes:
                items += await self.client.list(rk, namespace=ns, label_selector=f"{MANAGED_BY}={MANAGER}")
            fresh = set()
            for item in items:
                item.setdefault("apiVersion", rk.api_version)
                item.setdefault("kind", rk.kind)
                meta = item["metadata"]
                fresh.add((rk.kind, meta["namespace"], meta["name"]))
                self.state.cache_child(item)  # not over a newer version (a concurrent apply's answer)
            for stale in [k for k in children if k[0] == rk.kind and k not in fresh]:
                del children[stale]

    async def resync(self) -> None:
        """Queue a full reconcile of every object in scope and sweep the agent binding's stale subjects."""
        state = self.state
        scopes: tuple[str | None, ...] = self.settings.namespaces or (None,)
        try:
            pools, pdds = [], []
            for ns in scopes:
                pools += await self.client.list(KVPOOL, namespace=ns)
                pdds += await self.client.list(PDDEPLOYMENT, namespace=ns)
        except KubeError:
            # Still re-assert what we know: each key then retries on its own back-off until the apiserver is back.
            known: list[Key] = [(POOL, n, p) for n, p in state.pools] + [(PDD, n, d) for n, d in state.pool_of]
            for known_key in known:
                if state.queue.failures(known_key) == 0:
                    state.request(known_key, full=True)
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
                    state.cache_parent(key, obj)  # fresh from the LIST
                state.request(key, full=True)
        await self.binding.sweep(live)
        logger.debug("resync queued pools=%d pddeployments=%d", len(pools), len(pdds))
