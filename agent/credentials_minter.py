"""Mint the namespace credentials of the pool's PDDeployments as Secrets (the agents' Kubernetes side).

The operator renders engine and router pods with ``DAYBREAK_POOL_TOKEN`` from the Secret
``credential_secret_name(pdd, kvNamespace)`` but may not read Secrets, so it cannot derive the
credential; every agent holds the pool secret and can. Each agent watches the PDDeployments of its
pool's namespace and, for every one whose ``spec.poolRef`` names its pool, creates one Secret per
kvNamespace in use (the spec's, ``status.kvNamespace`` and, during a rollout, the retiring one).
Creation is idempotent (a 409 means some agent minted it already), so every agent may run this
without electing anyone. Its Role allows only ``list/watch pddeployments`` and ``create secrets``:
it cannot read, change or delete a Secret.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from typing import Any, cast

from kubernetes_asyncio import client as k8s_client
from kubernetes_asyncio import watch as k8s_watch
from kubernetes_asyncio.client.exceptions import ApiException

from daybreak.api.labels import GROUP, PDDEPLOYMENT_PLURAL, VERSION
from daybreak.client.kubewatch import WATCH_SECONDS, watch_with_backoff
from daybreak.pool.credentials import NAMESPACE_PATTERN
from daybreak.pool.engine_secret import credential_secret_name, engine_credential_secret

log = logging.getLogger(__name__)

PLURAL = PDDEPLOYMENT_PLURAL


def namespaces_in_use(pdd: Mapping[str, Any]) -> list[str]:
    """The kvNamespaces a PDDeployment's pods may use now: the spec's, the status's and the retiring one."""
    from daybreak.api.pddeployment import PDDeployment

    found: set[str] = set()
    try:
        found.add(PDDeployment.model_validate(dict(pdd)).spec.kv_namespace())
    except Exception as exc:
        log.debug("event=pdd_spec_unreadable pdd=%s error=%r", (pdd.get("metadata") or {}).get("name"), str(exc))
    status = pdd.get("status") or {}
    found.add(str(status.get("kvNamespace") or ""))
    found.add(str((status.get("retiringKVNamespace") or {}).get("kvNamespace") or ""))
    return sorted(ns for ns in found if ns and NAMESPACE_PATTERN.fullmatch(ns))


class CredentialMinter:
    """Creates the credential Secrets of one pool's PDDeployments; remembers what exists to skip repeats."""

    def __init__(self, api: k8s_client.ApiClient, *, namespace: str, pool: str, pool_secret: bytes) -> None:
        self.namespace = namespace
        self.pool = pool
        self._secret = pool_secret
        self._core = k8s_client.CoreV1Api(api)
        self._custom = k8s_client.CustomObjectsApi(api)
        self._done: set[tuple[str, str]] = set()  # (PDDeployment uid, kvNamespace) known to exist

    def wanted(self, pdd: Mapping[str, Any]) -> list[str]:
        """The namespaces to mint for ``pdd``: none unless it uses this pool."""
        if ((pdd.get("spec") or {}).get("poolRef") or {}).get("name") != self.pool:
            return []
        return namespaces_in_use(pdd)

    async def mint(self, pdd: Mapping[str, Any]) -> int:
        """Create the missing Secrets of ``pdd``; returns how many this call created."""
        meta = pdd.get("metadata") or {}
        name, uid = str(meta.get("name") or ""), str(meta.get("uid") or "")
        if not name or not uid or meta.get("deletionTimestamp"):
            return 0
        created = 0
        for ns in self.wanted(pdd):
            if (uid, ns) in self._done:
                continue
            body = engine_credential_secret(pool_secret=self._secret, kv_namespace=ns, pdd=name, pdd_uid=uid,
                                            namespace=self.namespace, pool=self.pool)
            try:
                # The client serialises a plain dict as is; its stubs only name the model class.
                await self._core.create_namespaced_secret(self.namespace, cast(Any, body))
            except ApiException as exc:
                if exc.status != 409:
                    raise
                # Another agent (or an earlier run of this one) minted it: the credential is the same.
            else:
                created += 1
                log.info("event=credential_minted pdd=%s/%s kv_namespace=%s secret=%s", self.namespace, name, ns,
                         credential_secret_name(name, ns))
            self._done.add((uid, ns))
        return created

    async def run(self, stop: asyncio.Event) -> None:
        """List and watch the namespace's PDDeployments until ``stop``; failures back off and retry."""
        def failed(exc: BaseException, retry_in: float) -> None:
            log.warning("event=credential_mint_failed pool=%s/%s error=%r retry_in=%.0fs", self.namespace,
                        self.pool, str(exc), retry_in)

        # A clean end is the server closing the watch at WATCH_SECONDS: list again, watch again, so a
        # fresh list this often re-mints anything missed (e.g. a Secret deleted by hand).
        await watch_with_backoff(self._watch_once, on_failure=failed, stop=stop)

    async def _watch_once(self, progress: Callable[[], None]) -> None:
        listing = await self._custom.list_namespaced_custom_object(GROUP, VERSION, self.namespace, PLURAL)
        for item in listing.get("items") or []:
            await self.mint(item)
        progress()  # the API answers again: the next failure waits the shortest time
        version = (listing.get("metadata") or {}).get("resourceVersion")
        async with k8s_watch.Watch().stream(
            self._custom.list_namespaced_custom_object, GROUP, VERSION, self.namespace, PLURAL,
            resource_version=version, timeout_seconds=WATCH_SECONDS,
        ) as stream:
            async for event in stream:
                kind = event.get("type")
                if kind == "ERROR":
                    raise RuntimeError(f"watch error: {event.get('raw_object') or event.get('object')}")
                if kind in ("ADDED", "MODIFIED"):
                    await self.mint(event.get("raw_object") or {})


async def mint_pool_credentials(api: k8s_client.ApiClient, *, namespace: str, pool: str, pool_secret: bytes,
                                stop: asyncio.Event) -> None:
    """Run a CredentialMinter for ``pool`` until ``stop``."""
    log.info("event=credential_minter_started pool=%s/%s", namespace, pool)
    await CredentialMinter(api, namespace=namespace, pool=pool, pool_secret=pool_secret).run(stop)
