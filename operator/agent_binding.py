"""The agents' one shared ClusterRoleBinding, ``daybreak-agents``: pool ServiceAccounts in and out of its subjects.

Agents need Node and KVNode rights (cluster-scoped). Instead of one
ClusterRoleBinding per pool, which would need create and delete on every
ClusterRoleBinding (cluster-admin's included), the chart ships one and the
operator only edits its subjects: get/update by resourceName. A subject cannot
carry an owner reference, so pool deletion and the re-sync's sweep remove stale
ones instead of a finalizer (docs/security.md).

ONE WRITER AT A TIME: the subjects are edited read-modify-write under a lock,
and every update carries the resourceVersion read, so a concurrent edit by
anyone else is a conflict that is retried, never a lost update.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from daybreak.operator import pool as pool_mod
from daybreak.operator.kube import CLUSTERROLEBINDING, KubeClient, KubeError

logger = logging.getLogger(__name__)

Subjects = list[dict[str, Any]]
CONFLICT_RETRIES = 5


class AgentBinding:
    """Edits the subjects of the shared agent ClusterRoleBinding for one leadership term."""

    def __init__(self, client: KubeClient, *, check_leader: Callable[[], None],
                 in_scope: Callable[[str], bool]) -> None:
        self.client = client
        self.check_leader = check_leader
        self.in_scope = in_scope
        # Subjects known to be there: a pool reconcile that finds its own needs no GET.
        self.bound: set[tuple[str, str]] = set()
        self._lock = asyncio.Lock()

    async def bind(self, ns: str, service_account: str) -> None:
        """Make the pool's agent ServiceAccount a subject (a no-op when it is known to be one)."""
        if (ns, service_account) in self.bound:
            return
        subject = pool_mod.agent_subject(ns, service_account)
        await self._edit(lambda old: sorted([*[s for s in old if s != subject], subject], key=pool_mod.subject_key))
        logger.info("bound agent ServiceAccount namespace=%s name=%s binding=%s", ns, service_account,
                    pool_mod.AGENT_BINDING)

    async def unbind(self, ns: str, service_account: str) -> None:
        subject = pool_mod.agent_subject(ns, service_account)
        await self._edit(lambda old: [s for s in old if s != subject])
        self.bound.discard((ns, service_account))

    async def sweep(self, live_pools: set[tuple[str, str]]) -> None:
        """Drop the subjects of pools that are gone (in this operator's scope only)."""
        live = {pool_mod.subject_key(pool_mod.agent_subject(ns, pool_mod.PoolNames(p, ns).service_account))
                for ns, p in live_pools}

        def keep(subject: dict[str, Any]) -> bool:
            ours = (subject.get("kind") == "ServiceAccount"
                    and str(subject.get("name", "")).endswith(pool_mod.AGENT_SA_SUFFIX)
                    and self.in_scope(str(subject.get("namespace", ""))))
            return not ours or pool_mod.subject_key(subject) in live

        await self._edit(lambda old: [s for s in old if keep(s)])

    async def _edit(self, change: Callable[[Subjects], Subjects]) -> None:
        async with self._lock:
            for _ in range(CONFLICT_RETRIES):
                self.check_leader()
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
                        self._remember(subjects)
                        return
                    binding["subjects"] = subjects
                    try:
                        await self.client.replace(CLUSTERROLEBINDING, binding)  # resourceVersion: no lost update
                    except KubeError as exc:
                        if exc.conflict:
                            continue
                        raise
                self._remember(subjects)
                return
            raise KubeError(status=409, reason="Conflict", message="the agent ClusterRoleBinding kept changing",
                            method="PUT", path=pool_mod.AGENT_BINDING)

    def _remember(self, subjects: Subjects) -> None:
        self.bound = {(str(s.get("namespace")), str(s.get("name"))) for s in subjects
                      if s.get("kind") == "ServiceAccount"}
