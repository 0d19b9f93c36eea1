"""What one leadership term knows between reconciles: cached objects and children, per-key bookkeeping, the queue.

The watch intake (``kopf_adapter``) writes the caches and queues keys; the
reconcilers read the caches and record what they applied; the re-sync
(``controller``) replaces the cached children with a LIST. Nothing here does
I/O, so every part above can be tested with a plain ``TermState``.

A key is ``(kind, namespace, name)``. ``request(key, full=True)`` is the one
way to ask for a FULL reconcile (re-apply every child); ``full=False`` asks only
for a status refresh. A key never reconciled in this term is always full.
ONE TERM, ONE STATE: a new leadership term starts from an empty one, so
nothing a previous term believed is trusted without a fresh look.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

from daybreak.api import labels as vocab
from daybreak.operator.children import MANAGER, WATCHED_KINDS
from daybreak.operator.kube import KVPOOL, PDDEPLOYMENT, Manifest, ResourceKind
from daybreak.operator.workqueue import WorkQueue

POOL = "KVPool"
PDD = "PDDeployment"
Key = tuple[str, str, str]  # (kind, namespace, name)


def resource_of(kind: str) -> ResourceKind:
    """The API resource of a parent kind (KVPool or PDDeployment)."""
    return KVPOOL if kind == POOL else PDDEPLOYMENT


def slim(obj: Manifest) -> Manifest:
    """A cached child without other managers' managedFields (memory: hundreds of children are cached)."""
    meta = dict(obj.get("metadata") or {})
    meta["managedFields"] = [m for m in meta.get("managedFields") or []
                             if m.get("manager") == MANAGER and m.get("operation") == "Apply"]
    return {"apiVersion": obj.get("apiVersion"), "kind": obj.get("kind"), "metadata": meta,
            "spec": obj.get("spec") or {}, "status": obj.get("status") or {}}


def _rv_key(obj: Manifest | None) -> int | None:
    """``obj``'s resourceVersion as a number, or None when it is not a comparable one.

    KEP-5504 (GA in Kubernetes 1.35) makes resourceVersions of one resource type comparable: a
    decimal integer without leading zeros (ordered by length, then lexically: as numbers).
    """
    rv = str(((obj or {}).get("metadata") or {}).get("resourceVersion") or "")
    if not rv.isdigit() or rv.startswith("0"):
        return None
    return int(rv)


def is_older(obj: Manifest, than: Manifest | None) -> bool:
    """Whether ``obj`` is a version of the object older than ``than`` (False when they cannot be compared).

    The caches hold what our own writes returned, and the watch delivers the events before each write
    afterwards: without this check such an event put the older body back, and a reconcile read a
    status field its last write had set as unset (a cache flush was requested again and freed 0
    bytes; a scale decision could be read as not made).
    """
    new, cached = _rv_key(obj), _rv_key(than)
    return new is not None and cached is not None and new < cached


def controller_owner(obj: Manifest) -> tuple[str, str] | None:
    """``(kind, name)`` of the Daybreak object that controls ``obj``, or None when it is not one of ours."""
    for ref in (obj.get("metadata") or {}).get("ownerReferences") or []:
        if ref.get("controller") and ref.get("apiVersion", "").startswith(vocab.GROUP + "/"):
            return str(ref.get("kind")), str(ref.get("name"))
    return None


class TermState:
    """Caches and bookkeeping of one leadership term (build a fresh one per term)."""

    def __init__(self, *, namespaces: tuple[str, ...], max_backoff_seconds: float) -> None:
        self.namespaces = namespaces  # empty: every namespace
        self.queue = WorkQueue[Key](max_delay=max_backoff_seconds)
        self.pools: dict[tuple[str, str], Manifest] = {}
        # Latest PDDeployment bodies from the watch (and our own status writes): a reconcile reads no GET.
        self.pdds: dict[tuple[str, str], Manifest] = {}
        self.children: dict[tuple[str, str, str], Manifest] = {}  # (kind, ns, name) -> slim(child)
        self.needs_apply: set[Key] = set()
        self.applied: set[Key] = set()
        self.own_status_rv: dict[Key, str] = {}
        self.generations: dict[Key, int] = {}
        self.pool_of: dict[tuple[str, str], str] = {}  # (ns, pdd) -> pool
        self.last_reconciled: dict[Key, float] = {}  # monotonic time of the last successful full reconcile

    def in_scope(self, namespace: str) -> bool:
        return not self.namespaces or namespace in self.namespaces

    def request(self, key: Key, *, full: bool) -> None:
        """Queue ``key``; ``full`` makes its next reconcile re-apply every child."""
        if full:
            self.needs_apply.add(key)
        self.queue.add(key)

    def touch_dependents(self, ns: str, pool: str, *, full: bool) -> None:
        """Queue every PDDeployment of ``pool`` (their status, and with ``full`` their children, follow it)."""
        for (dns, dname), pname in list(self.pool_of.items()):
            if dns == ns and pname == pool:
                self.request((PDD, dns, dname), full=full)

    def mark_applied(self, key: Key) -> None:
        """Every child of ``key`` was applied: later triggers may ask for a status refresh only."""
        self.applied.add(key)
        self.last_reconciled[key] = time.monotonic()

    def cached_child(self, kind: str, ns: str | None, name: str) -> Manifest | None:
        return self.children.get((kind, ns or "", name))

    def cache_child(self, obj: Manifest) -> bool:
        """Remember a child as the apiserver returned it (an apply, a watch event) unless the cache holds a
        newer version of it; returns whether it was stored."""
        meta = obj["metadata"]
        key = (str(obj.get("kind")), str(meta.get("namespace") or ""), str(meta["name"]))
        if is_older(obj, self.children.get(key)):
            return False
        self.children[key] = slim(obj)
        return True

    def cache_applied(self, objs: Iterable[Manifest]) -> None:
        """Remember the watched children (Deployments, DaemonSets) among what an apply returned: the status
        computed right after, and the applier's skip of an untouched child, read them from here."""
        for obj in objs:
            if obj.get("kind") in WATCHED_KINDS:
                self.cache_child(obj)

    def cache_parent(self, key: Key, body: Manifest) -> bool:
        """Remember a KVPool or PDDeployment body as the apiserver returned it (a write, a GET, a LIST, a
        watch event) unless the cache holds a newer version of it; returns whether it was stored."""
        cache: dict[tuple[str, str], Any] = self.pdds if key[0] == PDD else self.pools
        if is_older(body, cache.get((key[1], key[2]))):
            return False
        cache[(key[1], key[2])] = body
        return True
