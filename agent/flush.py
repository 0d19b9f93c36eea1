"""What an agent flushes: namespaces the KVPool's status asks for, and its whole tier when it leaves the pool.

The operator holds no store credential (it cannot read the pool Secret), so it never sends
FLUSH_NAMESPACE. It lists retired kvNamespaces in the KVPool's ``status.flushRequests``; every agent
already follows that object (``agent/membership.py``) and flushes its own store in-process here, then
publishes what it freed on its KVNode (``status.namespaceFlushes``), which the operator sums.

On SIGTERM a pool agent keeps its DRAM tier in /dev/shm only for an agent that will re-adopt it (a roll,
a restart); ``pool_keeps_node`` is the one rule deciding that, from the API (issue 12 finding 9): a
deleted (or deleting) KVPool, a deleted Node, or a nodeSelector this node no longer matches means the
DaemonSet runs no agent here again, so nobody would re-adopt the tier.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

from kubernetes_asyncio import client as k8s_client

from daybreak.agent.membership import GROUP, PLURAL, VERSION
from daybreak.api.node import NamespaceFlush
from daybreak.pool.credentials import NAMESPACE_PATTERN
from daybreak.pool.protocol import FlushReply

log = logging.getLogger(__name__)

RequestKey = tuple[str, str]  # (kvNamespace, requestedAt)


def flush_requests(pool: Mapping[str, Any]) -> list[RequestKey]:
    """The valid (kvNamespace, requestedAt) pairs of a KVPool object's ``status.flushRequests``, in order."""
    out: list[RequestKey] = []
    for entry in ((pool.get("status") or {}).get("flushRequests")) or []:
        ns = entry.get("kvNamespace") if isinstance(entry, Mapping) else None
        if not isinstance(ns, str) or not NAMESPACE_PATTERN.fullmatch(ns):
            log.warning("event=flush_request_ignored reason=invalid_namespace entry=%r", entry)
            continue
        key = (ns, str(entry.get("requestedAt") or ""))
        if key not in out:
            out.append(key)
    return out


class FlushLedger:
    """Runs each flush request once and remembers its result while the request is listed.

    A restarted agent repeats a listed request (a flush is idempotent: the second frees nothing
    more), so nothing needs to survive a restart.
    """

    def __init__(self, flush: Callable[[str], FlushReply]) -> None:
        self._flush = flush
        self._done: dict[RequestKey, NamespaceFlush] = {}
        self._lock = threading.Lock()

    def apply(self, requests: Sequence[RequestKey]) -> list[NamespaceFlush]:
        """Flush the requests not yet done, forget reports of requests no longer listed; returns the new ones."""
        wanted = list(requests)
        new: list[NamespaceFlush] = []
        with self._lock:
            for key in [k for k in self._done if k not in wanted]:
                del self._done[key]
            todo = [k for k in wanted if k not in self._done]
        for ns, requested_at in todo:
            reply = self._flush(ns)
            report = NamespaceFlush(kv_namespace=ns, requested_at=requested_at, bytes_freed=reply.bytes_freed,
                                    blocks=reply.blocks, busy=reply.busy,
                                    flushed_at=datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"))
            log.info("event=flush_request_done namespace=%s requested_at=%s bytes=%d blocks=%d busy=%d",
                     ns, requested_at, reply.bytes_freed, reply.blocks, reply.busy)
            with self._lock:
                self._done[(ns, requested_at)] = report
            new.append(report)
        return new

    def reports(self) -> list[NamespaceFlush]:
        """What the KVNode status lists (status.namespaceFlushes)."""
        with self._lock:
            return list(self._done.values())


def pool_keeps_node(pool: Mapping[str, Any] | None, node: Mapping[str, Any] | None) -> tuple[bool, str]:
    """Whether the pool's DaemonSet will run an agent on this node again (to re-adopt its tier), and why.

    ``pool`` and ``node`` are the API objects, None when they do not exist. The DaemonSet's nodeSelector
    is the KVPool's (``operator/pool.py``); taints are not considered (DaemonSet pods tolerate the
    node-condition ones, and a NoExecute taint evicts pods through the same SIGTERM).
    """
    if pool is None:
        return False, "pool_deleted"
    if (pool.get("metadata") or {}).get("deletionTimestamp"):
        return False, "pool_deleting"
    if node is None:
        return False, "node_deleted"
    selector: Mapping[str, str] = (pool.get("spec") or {}).get("nodeSelector") or {}
    labels: Mapping[str, str] = (node.get("metadata") or {}).get("labels") or {}
    unmatched = sorted(k for k, v in selector.items() if labels.get(k) != v)
    if unmatched:
        return False, "node_not_selected:" + ",".join(unmatched)
    return True, "pool_selects_node"


async def readopted_after_stop(api: k8s_client.ApiClient, *, namespace: str, pool: str,
                               node: str) -> tuple[bool, str]:
    """``pool_keeps_node`` for this agent's KVPool and Node, read now; API errors other than 404 raise."""
    custom = k8s_client.CustomObjectsApi(api)
    core = k8s_client.CoreV1Api(api)
    try:
        pool_obj: Mapping[str, Any] | None = await custom.get_namespaced_custom_object(
            GROUP, VERSION, namespace, PLURAL, pool)
    except k8s_client.ApiException as exc:
        if exc.status != 404:
            raise
        pool_obj = None
    try:
        node_obj: Mapping[str, Any] | None = (await core.read_node(node)).to_dict()
    except k8s_client.ApiException as exc:
        if exc.status != 404:
            raise
        node_obj = None
    if node_obj is not None:  # the typed model's snake_case: only metadata.labels is read
        node_obj = {"metadata": {"labels": (node_obj.get("metadata") or {}).get("labels") or {}}}
    return pool_keeps_node(pool_obj, node_obj)
