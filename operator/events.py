"""Kubernetes Events about our resources (created, updated, scaled, rollout, pool missing), posted async.

Events go through a bounded queue and one poster task, so a reconcile never
waits for them and an apiserver outage drops events rather than piling them
up. Repeats of the same (object, reason, message) within a few minutes bump
the count of the existing Event, as kubelet and the controllers do.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from daybreak.operator.kube import EVENT, KubeClient, KubeError

logger = logging.getLogger(__name__)

COMPONENT = "daybreak-operator"
NORMAL = "Normal"
WARNING = "Warning"
_REPEAT_WINDOW = 300.0  # seconds in which a repeat bumps the count instead of creating a new Event


@dataclass(frozen=True)
class _Pending:
    involved: dict[str, Any]
    type: str
    reason: str
    message: str


def involved_object(obj: dict[str, Any]) -> dict[str, Any]:
    meta = obj.get("metadata") or {}
    return {"apiVersion": obj.get("apiVersion"), "kind": obj.get("kind"), "name": meta.get("name"),
            "namespace": meta.get("namespace"), "uid": meta.get("uid"),
            "resourceVersion": meta.get("resourceVersion")}


class EventRecorder:
    """Queue Events for ``obj``; ``run()`` posts them (start it as a task)."""

    def __init__(self, client: KubeClient, *, maxsize: int = 1000) -> None:
        self.client = client
        self._queue: asyncio.Queue[_Pending] = asyncio.Queue(maxsize=maxsize)
        # (uid, reason, message) -> (event name, namespace, count, first posted at)
        self._recent: dict[tuple[str, str, str], tuple[str, str, int, float]] = {}

    def record(self, obj: dict[str, Any], *, reason: str, message: str, type: str = NORMAL) -> None:
        meta = obj.get("metadata") or {}
        logger.info("event kind=%s namespace=%s name=%s type=%s reason=%s message=%r",
                    obj.get("kind"), meta.get("namespace"), meta.get("name"), type, reason, message)
        with contextlib.suppress(asyncio.QueueFull):
            self._queue.put_nowait(_Pending(involved_object(obj), type, reason, message))

    async def run(self) -> None:
        while True:
            pending = await self._queue.get()
            try:
                await self._post(pending)
            except KubeError as exc:
                logger.debug("event post failed reason=%s error=%s", pending.reason, exc)

    async def _post(self, p: _Pending) -> None:
        namespace = p.involved.get("namespace") or "default"
        now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        key = (str(p.involved.get("uid")), p.reason, p.message)
        seen = self._recent.get(key)
        if seen and time.monotonic() - seen[3] < _REPEAT_WINDOW:
            name, ns, count, first = seen
            try:
                await self.client.patch_merge(EVENT, name, {"count": count + 1, "lastTimestamp": now}, namespace=ns)
                self._recent[key] = (name, ns, count + 1, first)
                return
            except KubeError as exc:
                if not exc.not_found:
                    raise
        name = f"{p.involved.get('name')}.{uuid.uuid4().hex[:12]}"
        body = {
            "apiVersion": "v1", "kind": "Event",
            "metadata": {"name": name, "namespace": namespace},
            "involvedObject": p.involved, "reason": p.reason, "message": p.message[:1024], "type": p.type,
            "source": {"component": COMPONENT}, "reportingComponent": COMPONENT,
            "firstTimestamp": now, "lastTimestamp": now, "count": 1,
        }
        await self.client.create(EVENT, body, namespace=namespace)
        if len(self._recent) > 5000:
            self._recent.clear()
        self._recent[key] = (name, namespace, 1, time.monotonic())
