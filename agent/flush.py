"""Namespace flushes asked for in the KVPool's status: run each once on this agent's store, keep the report.

The operator holds no store credential (it cannot read the pool Secret), so it never sends
FLUSH_NAMESPACE. It lists retired kvNamespaces in the KVPool's ``status.flushRequests``; every agent
already follows that object (``agent/membership.py``) and flushes its own store in-process here, then
publishes what it freed on its KVNode (``status.namespaceFlushes``), which the operator sums.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

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
