"""Status writes of both parent kinds, and the three ways a reconcile ends without applying: invalid, refused, failed.

Both reconcilers go through one ``StatusWriter`` so the rules live once: a
status equal to the stored one is not written (no new resourceVersion, no
watch event), every write checks the leader fence, and the resourceVersion of
our own write is remembered so its watch echo triggers nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from pydantic import ValidationError

from daybreak.operator.children import NotLeader
from daybreak.operator.conditions import FALSE, TRUE, Condition, merge
from daybreak.operator.events import WARNING, EventRecorder
from daybreak.operator.kube import KubeClient, KubeError, Manifest
from daybreak.operator.pool_policy import PolicyError
from daybreak.operator.state import Key, TermState, resource_of

logger = logging.getLogger(__name__)


class StatusWriter:
    """Writes ``status`` of KVPools and PDDeployments for the reconcilers of one term."""

    def __init__(self, client: KubeClient, state: TermState, *, events: EventRecorder,
                 check_leader: Callable[[], None]) -> None:
        self.client = client
        self.state = state
        self.events = events
        self.check_leader = check_leader

    async def write(self, key: Key, *, body: Manifest, status: dict[str, Any]) -> Manifest:
        """Merge-patch ``status`` onto ``body`` (the stored object) unless each field it names is stored so already.

        Fields ``status`` leaves out keep their stored value (a KVPool's ``flushRequests`` belong to the
        deployments' rollouts, not to the pool's reconcile); a field set to None is removed."""
        stored = body.get("status") or {}
        if all(stored.get(field) == value for field, value in status.items()):
            return body
        self.check_leader()
        meta = body["metadata"]
        updated = await self.client.patch_merge(resource_of(key[0]), meta["name"], {"status": status},
                                                namespace=meta["namespace"], subresource="status")
        rv = (updated.get("metadata") or {}).get("resourceVersion")
        if rv:
            self.state.own_status_rv[key] = rv
        self.state.cache_parent(key, updated)
        return updated

    async def invalid(self, key: Key, *, body: Manifest, exc: ValidationError) -> None:
        """The stored object does not parse: Ready=False InvalidSpec naming the first field at fault."""
        errors = exc.errors()
        if errors:
            where = ".".join(str(p) for p in errors[0]["loc"])
            message = f"{where}: {errors[0]['msg']}"
        else:
            message = str(exc)
        status = {"conditions": merge((body.get("status") or {}).get("conditions"), [
            Condition(type="Ready", status=FALSE, reason="InvalidSpec", message=message),
        ], generation=(body.get("metadata") or {}).get("generation"))}
        logger.warning("invalid object kind=%s namespace=%s name=%s error=%r", key[0], key[1], key[2], message)
        await self.write(key, body=body, status=status)

    async def refuse(self, key: Key, *, body: Manifest, exc: PolicyError) -> None:
        """The object asks for more than the pool policy allows: say which field, apply nothing."""
        message = str(exc)[:1000]
        status = {"conditions": merge((body.get("status") or {}).get("conditions"), [
            Condition(type="Ready", status=FALSE, reason="PolicyViolation", message=message),
        ], generation=(body.get("metadata") or {}).get("generation"))}
        logger.warning("refused by pool policy kind=%s namespace=%s name=%s violations=%r", key[0], key[1], key[2],
                       message)
        was: dict[str, Any] = next(
            (c for c in (body.get("status") or {}).get("conditions") or [] if c.get("type") == "Ready"), {})
        if was.get("message") != message:
            self.events.record(body, reason="PolicyViolation", message=message, type=WARNING)
        await self.write(key, body=body, status=status)

    async def report_failure(self, key: Key, message: str) -> None:
        """Best effort: put a failed reconcile where users look (a condition and an Event)."""
        kind, ns, name = key
        try:
            self.check_leader()
            body = await self.client.get(resource_of(kind), name, namespace=ns)
            status = {"conditions": merge((body.get("status") or {}).get("conditions"), [
                Condition(type="Ready", status=FALSE, reason="ReconcileFailed", message=message[:1000]),
                Condition(type="Degraded", status=TRUE, reason="ReconcileFailed", message=message[:1000]),
            ], generation=(body.get("metadata") or {}).get("generation"))}
            await self.write(key, body=body, status=status)
            self.events.record(body, reason="ReconcileFailed", message=message, type=WARNING)
        except (KubeError, NotLeader) as exc:
            logger.debug("could not report failure kind=%s name=%s error=%s", kind, name, exc)
