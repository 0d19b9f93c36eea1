"""A PDDeployment's rollout and its kvNamespace's retirement: hold decode for prefill, retire, flush the old namespace.

The state machine, per deployment, across reconciles (it lives in status, so
an operator restart resumes it):

1. HOLD. When the kvNamespace changes, prefill rolls first; decode keeps the
   old template until prefill is out (``deployment.rollout_holds``). The key
   is remembered as holding, so the reconcile after the hold lifts re-applies
   everything even when nothing else asks for it.
2. RETIRING. ``status.retiringKVNamespace`` names the previous namespace from
   the first reconcile of the new one until no engine uses it.
3. RETIRED. Per ``updateStrategy.cache``: ``retain`` leaves its blocks to the
   watermarks; ``flush`` asks the pool's agents through the KVPool's
   ``status.flushRequests`` (the operator holds no store credential) and sums
   their KVNode reports into ``status.retiredKVNamespace.bytesFreed``; a later
   reconcile, reading that sum back, withdraws the request.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from daybreak.api.pddeployment import PDDeployment, Role
from daybreak.operator import deployment as pdd_mod
from daybreak.operator import metrics
from daybreak.operator.events import EventRecorder
from daybreak.operator.kube import KVNODE, KVPOOL, KubeClient, KubeError, Manifest
from daybreak.operator.state import PDD, POOL, Key, TermState

logger = logging.getLogger(__name__)

Workloads = dict[Role, Manifest | None]
# Writes of a KVPool's flushRequests that lost to a concurrent one before the step gives up until the next reconcile.
CONFLICT_RETRIES = 5


class Rollout:
    """The rollout / retire state machine of every PDDeployment of one leadership term."""

    def __init__(self, client: KubeClient, state: TermState, *, events: EventRecorder,
                 check_leader: Callable[[], None]) -> None:
        self.client = client
        self.state = state
        self.events = events
        self.check_leader = check_leader
        self.holding: set[Key] = set()  # deployments whose decode waits for prefill's rollout

    def holds(self, key: Key, *, pdd: PDDeployment, live: Workloads) -> tuple[dict[Role, Manifest], bool]:
        """The roles kept on their live pod template for now, and whether a hold just lifted (so the
        reconcile must apply everything: prefill finished rolling to the new namespace, decode may follow)."""
        hold = pdd_mod.rollout_holds(pdd, live)
        return hold, not hold and key in self.holding

    def remember(self, key: Key, hold: dict[Role, Manifest]) -> None:
        """Record the hold once the reconcile applied it (a failed apply keeps the previous record)."""
        if hold:
            self.holding.add(key)
        else:
            self.holding.discard(key)

    def retire_namespace(self, body: Manifest, pdd: PDDeployment, *, old: dict[str, Any], status: dict[str, Any],
                         workloads: Workloads) -> None:
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
            # The operator holds no store credential: the agents flush (see flush_retired).
            message = f"{old_ns} retired; flush requested from the pool's agents (KVPool status.flushRequests)"
            self.events.record(body, reason="KVNamespaceFlushRequested", message=message)
        else:
            message = f"{old_ns} retired; its blocks stay until the pool's watermarks evict them"
            self.events.record(body, reason="KVNamespaceRetired", message=message)
        status["retiredKVNamespace"] = {**retiring, "policy": policy, "retiredAt": now, "message": message}
        status["retiringKVNamespace"] = None

    async def flush_retired(self, body: Manifest, *, pool_body: Manifest, status: dict[str, Any]) -> None:
        """updateStrategy.cache flush: ask the pool's agents through the KVPool status, then sum their KVNode reports.

        The request is (kvNamespace, retiredAt) in ``status.flushRequests`` of the KVPool; each agent flushes
        its own store in-process and lists what it freed in its KVNode's ``status.namespaceFlushes``. Once
        every agent of the pool (its endpoints) has answered, the sum goes to retiredKVNamespace.bytesFreed
        and an Event says so; the request leaves the KVPool only at a reconcile that reads that sum back
        from the stored object. Withdrawn in the same reconcile, an operator stopped before its status write
        found the request gone and no sum: it asked again, the agents freed nothing more, and 0 was stored.
        Until every agent has answered, each reconcile (or resync) looks again.
        """
        # A copy: ``status`` shares this dict with the cached body it is compared against before writing,
        # so editing it in place made the write look unnecessary and bytesFreed was never stored (the
        # request then went out again at every reconcile).
        retired = dict(status.get("retiredKVNamespace") or {})
        if retired.get("policy") != "flush" or not retired.get("retiredAt"):
            return
        try:
            if retired.get("bytesFreed") is None:
                await self._flush_step(body, pool_body=pool_body, status=status, retired=retired)
            else:
                await self._withdraw(pool_body, retired=retired)
        except KubeError as exc:  # the deployment's own status still gets written; the next reconcile retries
            logger.warning("cache flush step failed kvNamespace=%s status=%s error=%s; retrying at the next "
                           "reconcile", retired.get("kvNamespace"), exc.status, exc)

    @staticmethod
    def _is_request(entry: dict[str, Any], retired: dict[str, Any]) -> bool:
        return entry.get("kvNamespace") == retired.get("kvNamespace") and entry.get("requestedAt") == retired.get(
            "retiredAt")

    async def _flush_step(self, body: Manifest, *, pool_body: Manifest, status: dict[str, Any],
                          retired: dict[str, Any]) -> None:
        old_ns, at = str(retired.get("kvNamespace")), str(retired["retiredAt"])
        meta = body["metadata"]
        entry = {"kvNamespace": old_ns, "requestedAt": at, "requestedBy": f"{meta['namespace']}/{meta['name']}"}

        def ask(requests: list[dict[str, Any]]) -> list[dict[str, Any]] | None:
            return None if any(self._is_request(r, retired) for r in requests) else [*requests, entry]

        if await self._edit_requests(pool_body, ask):
            logger.info("flush requested namespace=%s name=%s kvNamespace=%s pool=%s", meta["namespace"],
                        meta["name"], old_ns, pool_body["metadata"]["name"])
            return
        pool_status = pool_body.get("status") or {}
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
        # The reconcile writes the sum after this returns; the one after it withdraws the request.
        self.state.request((PDD, meta["namespace"], meta["name"]), full=False)

    async def _withdraw(self, pool_body: Manifest, *, retired: dict[str, Any]) -> None:
        """The sum is stored: take the request off the KVPool (the agents then forget their reports)."""
        def withdraw(requests: list[dict[str, Any]]) -> list[dict[str, Any]] | None:
            rest = [r for r in requests if not self._is_request(r, retired)]
            return None if len(rest) == len(requests) else rest

        if await self._edit_requests(pool_body, withdraw):
            logger.info("flush request withdrawn kvNamespace=%s pool=%s bytesFreed=%s", retired.get("kvNamespace"),
                        pool_body["metadata"]["name"], retired.get("bytesFreed"))

    async def _edit_requests(self, pool_body: Manifest,
                             edit: Callable[[list[dict[str, Any]]], list[dict[str, Any]] | None]) -> bool:
        """Write ``edit(flushRequests)`` to the KVPool unless it returns None; whether it wrote.

        The list is shared by every deployment of the pool and rewritten whole (a merge patch replaces a
        list), so each write carries the resourceVersion it was computed from: a deployment that read the
        pool before another's request (or withdrawal) gets 409, reads the pool again and redoes its edit,
        instead of writing the other's change away.
        """
        meta = pool_body["metadata"]
        key = (POOL, meta["namespace"], meta["name"])
        body, attempt = pool_body, 0
        while True:
            attempt += 1
            edited = edit(list((body.get("status") or {}).get("flushRequests") or []))
            if edited is None:
                return False
            self.check_leader()
            patch = {"metadata": {"resourceVersion": (body.get("metadata") or {}).get("resourceVersion")},
                     "status": {"flushRequests": edited}}
            try:
                updated = await self.client.patch_merge(KVPOOL, meta["name"], patch, namespace=meta["namespace"],
                                                        subresource="status")
            except KubeError as exc:
                if not exc.conflict or attempt == CONFLICT_RETRIES:
                    raise
                logger.debug("flushRequests changed since read pool=%s; reading it again", meta["name"])
                body = await self.client.get(KVPOOL, meta["name"], namespace=meta["namespace"])
                self.state.cache_parent(key, body)
                continue
            self.state.cache_parent(key, updated)
            return True
