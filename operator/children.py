"""The one ownership-and-apply helper every child goes through: labels, owner reference, server-side apply.

Every reconciler builds plain manifests and hands them to ``Applier.apply``:
it stamps the standard labels and the controller owner reference (so the
garbage collector removes children with their parent), applies with the
single field manager ``daybreak-operator`` and ``force=true`` (the operator
is the authority on the fields it sets; anything else a human or another
controller set is left alone), counts the outcome and records Events. It
refuses to write when this process is not the leader any more.
"""

from __future__ import annotations

import asyncio
import copy
import hashlib
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from daybreak.api import labels as vocab
from daybreak.errors import DaybreakError
from daybreak.operator import metrics
from daybreak.operator.events import EventRecorder
from daybreak.operator.kube import FIELD_MANAGER, KubeClient, KubeError, Manifest, kind_of

logger = logging.getLogger(__name__)

# Label keys (app.kubernetes.io are the recommended labels; daybreak.dev say which parent and role).
# Declared once in api/labels.py (the vocabulary every process matches on); re-exported for the builders.
APPLIED_HASH = vocab.APPLIED_HASH
COMPONENT = vocab.COMPONENT
DEPLOYMENT = vocab.DEPLOYMENT
INSTANCE = vocab.INSTANCE
MANAGED_BY = vocab.MANAGED_BY
NAME = vocab.NAME
POOL = vocab.POOL
ROLE = vocab.ROLE

MANAGER = FIELD_MANAGER
# Kinds whose every change reaches us through a watch: an apply of an unchanged one can be skipped.
WATCHED_KINDS = frozenset({"Deployment", "DaemonSet"})


class NotLeader(DaybreakError, RuntimeError):
    """This process lost the Lease: it must not write."""


def standard_labels(*, name: str, instance: str, component: str, pool: str | None = None,
                    deployment: str | None = None, role: str | None = None) -> dict[str, str]:
    """The label set every child carries (``name`` is the application: daybreak-agent, daybreak-engine, ...)."""
    labels = {NAME: name, INSTANCE: instance, COMPONENT: component, MANAGED_BY: MANAGER}
    if pool:
        labels[POOL] = pool
    if deployment:
        labels[DEPLOYMENT] = deployment
    if role:
        labels[ROLE] = role
    return labels


def owner_reference(parent: Manifest) -> dict[str, Any]:
    """A controller owner reference to ``parent`` (blockOwnerDeletion for foreground deletes)."""
    meta = parent["metadata"]
    return {"apiVersion": parent["apiVersion"], "kind": parent["kind"], "name": meta["name"], "uid": meta["uid"],
            "controller": True, "blockOwnerDeletion": True}


@dataclass
class ApplyResult:
    obj: Manifest
    outcome: str  # created | updated | unchanged | skipped


def _manager_time(obj: Manifest | None) -> str | None:
    for entry in ((obj or {}).get("metadata") or {}).get("managedFields") or []:
        if entry.get("manager") == MANAGER and entry.get("operation") == "Apply":
            return str(entry.get("time"))
    return None


class Applier:
    """Applies children of a parent; shared by all reconcilers."""

    def __init__(self, client: KubeClient, *, events: EventRecorder, fence: Callable[[], bool],
                 cache: Callable[[str, str | None, str], Manifest | None] | None = None) -> None:
        self.client = client
        self.events = events
        self.fence = fence
        self._cached = cache or (lambda kind, ns, name: None)
        # (kind, namespace, name) -> (hash of what we applied, the object's generation right after)
        self._applied: dict[tuple[str, str, str], tuple[str, int]] = {}

    def check_leader(self) -> None:
        if not self.fence():
            raise NotLeader("the leader Lease is not held (or not renewed in time); refusing to write")

    async def apply(self, parent: Manifest | None, manifest: Manifest, *, labels: dict[str, str],
                    owned: bool = True) -> ApplyResult:
        """Server-side apply ``manifest`` as a child of ``parent`` (namespace and owner taken from it)."""
        self.check_leader()
        body = copy.deepcopy(manifest)
        meta = body.setdefault("metadata", {})
        kind = kind_of(body)
        body.setdefault("apiVersion", kind.api_version)
        if parent is not None and kind.namespaced:
            meta.setdefault("namespace", parent["metadata"]["namespace"])
        meta["labels"] = {**(meta.get("labels") or {}), **labels}
        if parent is not None and owned:
            meta["ownerReferences"] = [owner_reference(parent)]
        before = self._cached(kind.kind, meta.get("namespace"), meta["name"])
        key = (kind.kind, str(meta.get("namespace") or ""), str(meta["name"]))
        digest = ""
        if kind.kind in WATCHED_KINDS:
            digest = hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:16]
            meta["annotations"] = {**(meta.get("annotations") or {}), APPLIED_HASH: digest}
            if before is not None and self._unchanged(key, digest, before, meta):
                # Same desired state, and nobody changed the object since our last apply (its generation
                # would have moved, and the watch would have told us): the apply would be a no-op.
                metrics.CHILDREN_APPLIED.labels(kind=kind.kind, outcome="skipped").inc()
                return ApplyResult(before, "skipped")
        obj, created = await self.client.apply(body)  # errors are counted once, by the reconcile that failed
        if digest:
            self._applied[key] = (digest, int((obj.get("metadata") or {}).get("generation") or 0))
        if created:
            outcome = "created"
        elif before is not None and _manager_time(before) != _manager_time(obj):
            outcome = "updated"
        else:
            outcome = "unchanged"
        metrics.CHILDREN_APPLIED.labels(kind=kind.kind, outcome=outcome).inc()
        return ApplyResult(obj, outcome)

    def _unchanged(self, key: tuple[str, str, str], digest: str, live: Manifest, desired_meta: Manifest) -> bool:
        recorded = self._applied.get(key)
        meta = live.get("metadata") or {}
        if recorded is None or recorded != (digest, int(meta.get("generation") or 0)):
            return False
        if (meta.get("annotations") or {}).get(APPLIED_HASH) != digest:
            return False
        labels = meta.get("labels") or {}
        if any(labels.get(k) != v for k, v in (desired_meta.get("labels") or {}).items()):
            return False  # label edits do not move the generation
        owners = {r.get("uid") for r in meta.get("ownerReferences") or []}
        return all(r.get("uid") in owners for r in desired_meta.get("ownerReferences") or [])

    async def apply_all(self, parent: Manifest, children: list[tuple[Manifest, dict[str, str]]], *,
                        concurrent: bool = False) -> list[ApplyResult]:
        """Apply ``(manifest, labels)`` pairs as children of ``parent``; one Event per outcome sums them up.

        ``concurrent`` for independent children; otherwise in order (a ServiceAccount before the
        DaemonSet whose pods use it).
        """
        if concurrent:
            results = list(await asyncio.gather(*(self.apply(parent, m, labels=labels) for m, labels in children)))
        else:
            results = [await self.apply(parent, m, labels=labels) for m, labels in children]
        for outcome, reason in (("created", "Created"), ("updated", "Updated")):
            names = [f"{r.obj.get('kind')} {r.obj['metadata']['name']}" for r in results if r.outcome == outcome]
            if names:
                self.events.record(parent, reason=reason, message=f"{outcome} {', '.join(names)}")
        return results

    async def create_once(self, parent: Manifest, manifest: Manifest, *, labels: dict[str, str]) -> Manifest:
        """Create ``manifest`` if absent and never modify it afterwards (generated secrets must not rotate).

        A plain POST, no GET first: the operator may create Secrets but not read them, so an existing one
        (409) is left as it is and the desired manifest is returned in its place."""
        self.check_leader()
        kind = kind_of(manifest)
        meta = manifest["metadata"]
        namespace = meta.get("namespace") or parent["metadata"]["namespace"]
        body = copy.deepcopy(manifest)
        body.setdefault("apiVersion", kind.api_version)
        body["metadata"] = {**meta, "namespace": namespace, "labels": {**(meta.get("labels") or {}), **labels},
                            "ownerReferences": [owner_reference(parent)]}
        try:
            created = await self.client.create(kind, body, namespace=namespace)
        except KubeError as exc:
            if exc.conflict:  # exists (created earlier, or by a previous leader): keep it, never read it
                return body
            raise
        metrics.CHILDREN_APPLIED.labels(kind=kind.kind, outcome="created").inc()
        self.events.record(parent, reason="Created", message=f"created {kind.kind} {meta['name']}")
        return created


def dns_name(*parts: str, limit: int = 63) -> str:
    """``parts`` joined by '-'; when longer than ``limit``, the leading parts are cut and a hash of the
    whole name is inserted, keeping the last part (the role suffix: -agent, -prefill) readable and stable."""
    parts = tuple(p for p in parts if p)
    name = "-".join(parts)
    if len(name) <= limit:
        return name
    digest = hashlib.sha256(name.encode()).hexdigest()[:8]
    tail = parts[-1] if len(parts) > 1 and len(parts[-1]) < limit // 2 else ""
    room = limit - len(digest) - 1 - (len(tail) + 1 if tail else 0)
    head = name[: len(name) - len(tail) - 1] if tail else name
    return "-".join(p for p in (head[:room].rstrip("-."), digest, tail) if p)
