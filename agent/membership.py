"""Pool membership in a cluster: the store's peers are the endpoints the operator publishes on the KVPool.

The operator writes ``status.endpoints`` (one entry per ready agent pod) on
the pool; each agent watches that one object (field selector on its name, the
only KVPool its Role may read) and hands the address list to the store, which
pings new peers and drops departed ones. There is no master: a missed event
costs nothing because every event carries the full list, and a broken watch
is restarted with back-off while the store keeps serving the peers it knows.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from typing import Any

from kubernetes_asyncio import client as k8s_client
from kubernetes_asyncio import watch as k8s_watch

from daybreak.api.labels import GROUP, KVPOOL_PLURAL, VERSION
from daybreak.client.kubewatch import WATCH_SECONDS, watch_with_backoff

log = logging.getLogger(__name__)

PLURAL = KVPOOL_PLURAL


def pool_endpoints(pool: Mapping[str, Any]) -> list[str]:
    """``host:port`` of every endpoint in a KVPool object's status, sorted, without duplicates."""
    entries = ((pool.get("status") or {}).get("endpoints")) or []
    return sorted({f"{e['address']}:{e['port']}" for e in entries if e.get("address") and e.get("port")})


async def follow_pool_endpoints(api: k8s_client.ApiClient, *, namespace: str, pool: str,
                                on_change: Callable[[list[str]], None], stop: asyncio.Event,
                                timeout_seconds: int = WATCH_SECONDS, on_deleted: Callable[[], None] | None = None,
                                on_pool: Callable[[dict[str, Any]], None] | None = None) -> None:
    """Call ``on_change`` with the pool's endpoint list whenever it changes, until ``stop`` is set.

    ``on_pool`` sees every version of the pool object (the agent's flush requests, ``agent/flush.py``).

    ``on_deleted`` runs when the pool itself is deleted (its agent then flushes its tier on stop).
    """
    custom = k8s_client.CustomObjectsApi(api)
    current: list[str] | None = None

    async def watch_once(progress: Callable[[], None]) -> None:
        nonlocal current
        async with k8s_watch.Watch().stream(
            custom.list_namespaced_custom_object, GROUP, VERSION, namespace, PLURAL,
            field_selector=f"metadata.name={pool}", timeout_seconds=timeout_seconds,
        ) as stream:
            async for event in stream:
                progress()
                if event.get("type") == "DELETED":
                    addresses: list[str] = []
                    if on_deleted is not None:
                        on_deleted()
                else:
                    obj = event.get("raw_object") or {}
                    addresses = pool_endpoints(obj)
                    if on_pool is not None:
                        try:
                            on_pool(obj)
                        except Exception:  # a failed flush must not stop the membership watch
                            log.exception("event=pool_callback_failed pool=%s/%s", namespace, pool)
                if addresses != current:
                    log.info("event=pool_members pool=%s/%s members=%d addresses=%s", namespace, pool,
                             len(addresses), ",".join(addresses))
                    current = addresses
                    on_change(addresses)

    def failed(exc: BaseException, retry_in: float) -> None:
        log.warning("event=pool_watch_failed pool=%s/%s error=%r retry_in=%.0fs", namespace, pool, str(exc), retry_in)

    await watch_with_backoff(watch_once, on_failure=failed, stop=stop)
