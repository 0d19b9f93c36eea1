"""kopf's side of a leadership term: the login, the four watches, and the intake that turns events into queued keys.

kopf provides the watches (with their reconnects and back-off); its handlers
here never touch the API themselves. Each event only updates ``TermState``'s
caches and queues a key, and decides how deep the reconcile must go: a FULL
reconcile (re-apply every child) after a spec change, a child's deletion or
edit, or a pool appearing or vanishing; a STATUS refresh after a child's status
changed. Our own status writes come back as watch events and are recognised by
their resourceVersion, so they trigger nothing.

THE INTAKE IS SYNCHRONOUS AND CHEAP: the watch must never wait on a reconcile.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import kopf

from daybreak.operator.children import MANAGED_BY, MANAGER
from daybreak.operator.kube import DAEMONSET, DEPLOYMENT, KVPOOL, PDDEPLOYMENT, Credentials, Manifest
from daybreak.operator.state import PDD, POOL, Key, TermState, controller_owner


class EventIntake:
    """Watch events of KVPools, PDDeployments and their children, into ``state``'s caches and queue."""

    def __init__(self, state: TermState, *, forget_deployment: Callable[[str, str], None]) -> None:
        self.state = state
        self.forget_deployment = forget_deployment  # (namespace, name) of a deleted PDDeployment

    def _scoped(self, kind: str, obj: Manifest) -> tuple[Key, dict[str, Any]] | None:
        """The object's key and metadata, or None when its namespace is outside the operator's scope."""
        meta = obj.get("metadata") or {}
        ns, name = meta.get("namespace", ""), meta.get("name", "")
        return ((kind, ns, name), meta) if self.state.in_scope(ns) else None

    def _spec_changed(self, key: Key, meta: dict[str, Any]) -> bool | None:
        """None for the echo of our own status write; else whether the generation moved (and record it)."""
        state = self.state
        if meta.get("resourceVersion") == state.own_status_rv.get(key):
            return None
        generation = int(meta.get("generation") or 0)
        seen = state.generations.get(key)
        if seen is not None and generation <= seen:
            return False  # the same spec, or an event older than one already seen
        state.generations[key] = generation
        return True

    def on_pool_event(self, type_: str | None, obj: Manifest) -> None:
        state = self.state
        scoped = self._scoped(POOL, obj)
        if scoped is None:
            return
        key, meta = scoped
        ns, name = key[1], key[2]
        if type_ == "DELETED":
            state.pools.pop((ns, name), None)
            state.generations.pop(key, None)  # a pool created again under the name starts at generation 1
            state.request(key, full=True)
            state.touch_dependents(ns, name, full=True)
            return
        known = (ns, name) in state.pools
        # An event older than the cached body (what our own write returned) still says whether the spec
        # moved, but never replaces the newer body.
        state.cache_parent(key, obj)
        changed = self._spec_changed(key, meta)
        if changed is None:
            return
        if changed or not known:
            state.needs_apply.add(key)
            state.touch_dependents(ns, name, full=True)
        state.queue.add(key)

    def on_pdd_event(self, type_: str | None, obj: Manifest) -> None:
        state = self.state
        scoped = self._scoped(PDD, obj)
        if scoped is None:
            return
        key, meta = scoped
        ns, name = key[1], key[2]
        if type_ == "DELETED":
            state.pool_of.pop((ns, name), None)
            state.pdds.pop((ns, name), None)
            for cache in (state.generations, state.own_status_rv, state.last_reconciled):
                cache.pop(key, None)
            state.applied.discard(key)
            self.forget_deployment(ns, name)
            return  # the garbage collector removes the children (owner references)
        state.pool_of[(ns, name)] = str(((obj.get("spec") or {}).get("poolRef") or {}).get("name", ""))
        state.cache_parent(key, obj)  # unless it is older than the cached body (see on_pool_event)
        if self._spec_changed(key, meta):
            state.request(key, full=True)

    def on_child_event(self, type_: str | None, obj: Manifest) -> None:
        state = self.state
        meta = obj.get("metadata") or {}
        ns, name = meta.get("namespace", ""), meta.get("name", "")
        owner = controller_owner(obj)
        if owner is None or not state.in_scope(ns):
            return
        kind = str(obj.get("kind") or ("DaemonSet" if owner[0] == POOL else "Deployment"))
        ckey = (kind, ns, name)
        parent: Key = (owner[0], ns, owner[1])
        if type_ == "DELETED":
            state.children.pop(ckey, None)
            state.request(parent, full=True)  # drift: put it back now, not at the next re-sync
            return
        old = state.children.get(ckey)
        if not state.cache_child(obj):
            return  # older than what our own apply returned, which already holds this change
        # Its spec changed (maybe a hand edit): re-assert ours.
        changed = old is not None and (old.get("metadata") or {}).get("generation") != meta.get("generation")
        state.request(parent, full=changed)


def registry(intake: EventIntake, credentials: Credentials) -> kopf.OperatorRegistry:
    """A kopf registry whose handlers only feed ``intake`` (and log in with ``credentials``)."""
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
        intake.on_pool_event(event.get("type"), dict(event["object"]))

    @kopf.on.event(PDDEPLOYMENT.group, PDDEPLOYMENT.version, PDDEPLOYMENT.plural, registry=registry)
    async def _pdd(event: kopf.RawEvent, **_: Any) -> None:
        intake.on_pdd_event(event.get("type"), dict(event["object"]))

    # kopf filters labels client-side; these watches are the namespace's Deployments/DaemonSets.
    @kopf.on.event(DEPLOYMENT.group, DEPLOYMENT.version, DEPLOYMENT.plural, registry=registry,
                   labels={MANAGED_BY: MANAGER})
    async def _deployment(event: kopf.RawEvent, **_: Any) -> None:
        intake.on_child_event(event.get("type"), dict(event["object"]))

    @kopf.on.event(DAEMONSET.group, DAEMONSET.version, DAEMONSET.plural, registry=registry,
                   labels={MANAGED_BY: MANAGER})
    async def _daemonset(event: kopf.RawEvent, **_: Any) -> None:
        intake.on_child_event(event.get("type"), dict(event["object"]))

    return registry
