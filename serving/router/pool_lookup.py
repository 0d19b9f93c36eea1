"""The router's pool lookup: how many leading blocks of a prompt the pool holds, per kvNamespace.

One round trip of ``batch_exists`` per 1,024 keys, stopping at the first miss.
The answer is advisory: a pool that cannot be reached is answered None and the
request is routed on load alone (and always prefilled), so a pool problem never
fails a request.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable

from daybreak.client import AsyncKVPoolClient
from daybreak.pool import credentials
from daybreak.serving.router import choice

log = logging.getLogger(__name__)

_EXISTS_CHUNK = 1024  # keys per batch_exists round trip

EndpointLister = Callable[[], Awaitable[list[str]]]
"""The pool agents' ``host:port`` addresses, asked again at every (re)connect."""

_POOL_NAMESPACES = 4  # kvNamespaces with open pool clients at once (an upgrade has two live)


class PoolLookup:
    """How long a prefix the pool holds, through a few ``AsyncKVPoolClient``s per kvNamespace.

    Each client serialises its calls and is bound to one kvNamespace; the request's namespace comes
    from its engine pods' label (``namespace`` is the fallback for unlabelled, static pods). The lookup
    is advisory: when the pool cannot be reached it answers None and the router routes on load alone
    (and always prefills), retrying the connection at most once a second.
    """

    def __init__(self, *, endpoints: EndpointLister, token: str, namespace: str | None = None,
                 clients: int = 4, tls_ca_file: str | None = None) -> None:
        self._endpoints = endpoints
        self._token = token
        self._tls_ca_file = tls_ca_file
        """The pool's CA when its agents speak TLS (``spec.tls``); None: plain tcp."""
        self._namespace = namespace
        # A namespace credential opens only its own namespace: during an upgrade this router's pods of
        # the other generation are routed on load alone instead of failing a handshake per request.
        scope, _ = credentials.parse(token)
        self._only = scope.namespace if scope.role == credentials.NAMESPACE else None
        self._skipped: set[str] = set()
        self._clients = clients
        self._slots: dict[str, asyncio.Queue[AsyncKVPoolClient | None]] = {}
        self._retry_at = 0.0
        self._failing = False

    async def _queue(self, namespace: str) -> asyncio.Queue[AsyncKVPoolClient | None]:
        queue = self._slots.get(namespace)
        if queue is None:
            if len(self._slots) >= _POOL_NAMESPACES:  # the oldest namespace is the one an upgrade retired
                oldest = next(iter(self._slots))
                await self._close_idle(self._slots.pop(oldest))
            queue = asyncio.Queue()
            for _ in range(self._clients):
                queue.put_nowait(None)
            self._slots[namespace] = queue
        return queue

    async def prefix(self, keys: list[str], *, namespace: str | None = None) -> int | None:
        """Leading ``keys`` the pool holds in ``namespace``, or None when it could not be asked."""
        if not keys:
            return 0
        namespace = namespace or self._namespace
        if not namespace:
            return None  # no kvNamespace known: nothing to ask
        if self._only is not None and namespace != self._only:
            if namespace not in self._skipped:
                self._skipped.add(namespace)
                log.info("event=pool_lookup_skipped namespace=%s reason=credential_is_for_%s "
                         "action=route_on_load_and_prefill", namespace, self._only)
            return None
        queue = await self._queue(namespace)
        client = await queue.get()
        try:
            if client is None:
                if time.monotonic() < self._retry_at:
                    return None
                client = await self._connect(namespace)
                if client is None:
                    return None
            held = 0
            for start in range(0, len(keys), _EXISTS_CHUNK):
                chunk = keys[start:start + _EXISTS_CHUNK]
                found = await client.batch_exists(chunk)
                run = choice.pool_prefix(found)
                held += run
                if run < len(chunk):
                    break
            if self._failing:
                log.info("event=pool_lookup_recovered")
                self._failing = False
            return held
        except Exception as exc:  # advisory: a pool problem must never fail a request
            self._note_failure(exc)
            if client is not None:
                with contextlib.suppress(Exception):
                    await client.close()
            client = None
            return None
        finally:
            if self._slots.get(namespace) is queue:
                queue.put_nowait(client)
            elif client is not None:  # its namespace was evicted meanwhile
                with contextlib.suppress(Exception):
                    await client.close()

    async def _connect(self, namespace: str) -> AsyncKVPoolClient | None:
        try:
            endpoints = await self._endpoints()
            if not endpoints:
                raise RuntimeError("the pool publishes no endpoints yet")
            return await AsyncKVPoolClient.connect(endpoints, token=self._token, namespace=namespace,
                                                   transport="tcp", timeout_seconds=5.0,
                                                   tls_ca_file=self._tls_ca_file)
        except Exception as exc:
            self._note_failure(exc)
            return None

    def _note_failure(self, exc: BaseException) -> None:
        self._retry_at = time.monotonic() + 1.0
        if not self._failing:
            log.warning("event=pool_lookup_failed error=%r action=route_on_load_and_prefill", str(exc) or
                        type(exc).__name__)
        self._failing = True

    @staticmethod
    async def _close_idle(queue: asyncio.Queue[AsyncKVPoolClient | None]) -> None:
        """Close the idle clients of ``queue``; those in use are closed when they come back."""
        while not queue.empty():
            client = queue.get_nowait()
            if client is not None:
                with contextlib.suppress(Exception):
                    await client.close()

    async def close(self) -> None:
        for queue in list(self._slots.values()):
            await self._close_idle(queue)
