"""Pool discovery through the Kubernetes API: the agents a KVPool publishes in ``status.endpoints``.

Any engine needs to know where the pool's agents are. The operator publishes
every ready agent in the KVPool's status, so an engine pod reads that one
object instead of resolving the agents' headless Service: no cluster DNS or
kube-proxy is needed (the local cluster has neither), and a real cluster keeps
DNS off the data path. The agents the client reaches first tell it about the
rest (``KVPoolClient`` learns the membership from them), so a one-shot read of
the seeds at start-up is enough.

Credentials come from ``KUBECONFIG`` when set (the local process kubelet
writes one per pod) and from the pod's ServiceAccount otherwise; the
operator's per-PDDeployment Role allows ``get`` on exactly the pool.

``kubernetes_asyncio`` (and aiohttp under it) is imported inside the functions
that use it: ``import daybreak.client`` must stay light, and machines without
the Kubernetes client (the GPU check scripts) never load this module's I/O.
The API functions are coroutines with a timeout per call;
``discover_pool_endpoints`` is the synchronous entry point for engines that
have no event loop of their own (vLLM's connector): it runs on a private loop
in a thread of its own, so it also works when the caller's thread runs a loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import re
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from daybreak.api.labels import API_VERSION, KVPOOL_PLURAL
from daybreak.client.kubeconfig import SERVICE_ACCOUNT_DIR
from daybreak.errors import DaybreakError

if TYPE_CHECKING:
    from kubernetes_asyncio.client import ApiClient

log = logging.getLogger(__name__)

# Seconds per API call: callers poll about every second, so a slow call must not pile up.
REQUEST_TIMEOUT = 5.0
# Between reads of a pool that has no endpoints yet: agents come up within seconds of each other.
POLL_SECONDS = 1.0
# A waiting engine says so at most this often (a minute of waiting is 4 lines, not 60).
_WAIT_LOG_SECONDS = 15.0
# namespace/name, both DNS labels or subdomains as Kubernetes names them.
_POOL_REF = re.compile(r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?/[a-z0-9]([-a-z0-9.]*[a-z0-9])?")


class KubeLookupError(DaybreakError):
    """An API read failed; ``status`` is the HTTP status, 0 when the API server was unreachable."""

    def __init__(self, path: str, *, status: int, message: str) -> None:
        self.status = status
        super().__init__(f"GET {path}: {status or 'unreachable'}: {message}")


class PoolDiscoveryError(DaybreakError):
    """The pool's endpoints could not be found through the API; the message names the pool and the last cause."""


class PoolRefError(PoolDiscoveryError):
    """A pool reference that is not ``NAMESPACE/NAME``."""


def parse_pool_ref(ref: str) -> tuple[str, str]:
    """``(namespace, name)`` of a ``NS/NAME`` pool reference; raises ``PoolRefError`` otherwise."""
    ref = ref.strip()
    if not _POOL_REF.fullmatch(ref):
        raise PoolRefError(f"pool reference {ref!r} is not NAMESPACE/NAME (e.g. 'default/kv-pool')")
    namespace, _, name = ref.partition("/")
    return namespace, name


async def load_api(kubeconfig: str | None = None, *, service_account_dir: str = SERVICE_ACCOUNT_DIR,
                   user_agent: str = "daybreak") -> ApiClient:
    """An ApiClient from ``kubeconfig`` (default: ``$KUBECONFIG``; ``""``: none), else the in-cluster ServiceAccount.

    Raises ``KubeLookupError`` (status 0) naming both sources when neither is there.
    """
    from kubernetes_asyncio import client as k8s_client

    from daybreak.client.kubeconfig import KubeConfigError, load_kube_config

    try:
        configuration = (await load_kube_config(kubeconfig, service_account_dir=service_account_dir)).configuration
    except KubeConfigError as exc:
        raise KubeLookupError("(config)", status=0, message=str(exc)) from None
    api = k8s_client.ApiClient(configuration)
    api.user_agent = user_agent
    return api


async def get_json(api: ApiClient, path: str, *, query: Mapping[str, str] | None = None,
                   timeout_seconds: float = REQUEST_TIMEOUT) -> Any:
    """GET ``path`` (e.g. ``/apis/daybreak.dev/v1alpha1/namespaces/ns/kvpools/p``) and return the decoded body."""
    import aiohttp
    from kubernetes_asyncio.client.exceptions import ApiException

    try:
        return await api.call_api(path, "GET", query_params=list((query or {}).items()),
                                  header_params={"Accept": "application/json"},
                                  response_types_map={200: "object"}, auth_settings=["BearerToken"],
                                  _return_http_data_only=True, _request_timeout=timeout_seconds)
    except ApiException as exc:
        raise KubeLookupError(path, status=int(exc.status or 0), message=str(exc.reason or exc)) from None
    except (TimeoutError, aiohttp.ClientError, OSError) as exc:
        raise KubeLookupError(path, status=0, message=str(exc) or type(exc).__name__) from None


def join_host_port(address: str, port: int) -> str:
    """``host:port``, with brackets around an IPv6 address."""
    return f"[{address}]:{port}" if ":" in address else f"{address}:{port}"


def endpoints_from_pool(obj: Mapping[str, Any]) -> list[str]:
    """``host:port`` of each ``status.endpoints`` entry (``{node, address, port, transports}``) of a KVPool."""
    out: set[str] = set()
    for entry in (obj.get("status") or {}).get("endpoints") or []:
        if not isinstance(entry, Mapping):
            continue
        address, port = entry.get("address"), entry.get("port")
        if isinstance(address, str) and address and isinstance(port, int) and 0 < port < 65536:
            out.add(join_host_port(address, port))
    return sorted(out)


def pool_path(namespace: str, pool: str) -> str:
    """The API path of a KVPool."""
    return f"/apis/{API_VERSION}/namespaces/{namespace}/{KVPOOL_PLURAL}/{pool}"


async def pool_endpoints(api: ApiClient, *, namespace: str, pool: str) -> list[str]:
    """The ``host:port`` of every ready agent the operator published in the KVPool's status."""
    return endpoints_from_pool(await get_json(api, pool_path(namespace, pool)))


async def wait_for_pool_endpoints(api: ApiClient, *, namespace: str, pool: str, timeout_seconds: float,
                                  poll_seconds: float = POLL_SECONDS) -> list[str]:
    """The pool's published endpoints, re-read until there is at least one or ``timeout_seconds`` pass.

    Every failure is retried (the pool, its Role or its agents may come up after the engine): a
    missing pool (404), a refused read (403), an unreachable API server, a status with no endpoints.
    Raises ``PoolDiscoveryError`` with the last cause when the time is up.
    """
    ref = f"{namespace}/{pool}"
    deadline = time.monotonic() + timeout_seconds
    started = time.monotonic()
    logged_at: float | None = None
    while True:
        try:
            found = await pool_endpoints(api, namespace=namespace, pool=pool)
            cause = "the KVPool publishes no endpoints yet (no agent is ready)"
        except KubeLookupError as exc:
            found, cause = [], str(exc)
        if found:
            log.info("event=pool_discovered pool=%s endpoints=%s seconds=%.1f", ref, ",".join(found),
                     time.monotonic() - started)
            return found
        now = time.monotonic()
        if now >= deadline:
            raise PoolDiscoveryError(f"KVPool {ref}: no endpoints after {timeout_seconds:g}s; last: {cause}")
        if logged_at is None or now - logged_at >= _WAIT_LOG_SECONDS:
            log.warning("event=pool_endpoints_wait pool=%s cause=%r waited_seconds=%.0f timeout_seconds=%g",
                        ref, cause, now - started, timeout_seconds)
            logged_at = now
        await asyncio.sleep(min(poll_seconds, max(0.0, deadline - now)))


def discover_pool_endpoints(pool_ref: str, *, timeout_seconds: float, kubeconfig: str | None = None,
                            poll_seconds: float = POLL_SECONDS) -> list[str]:
    """Synchronously: the ``host:port`` the KVPool ``NS/NAME`` publishes, waiting up to ``timeout_seconds``.

    ``kubeconfig`` as in ``load_api``. Raises ``PoolDiscoveryError`` when the reference is malformed,
    when there are no credentials (at once: waiting cannot fix that) or when the time is up.
    """
    namespace, name = parse_pool_ref(pool_ref)

    async def run() -> list[str]:
        try:
            api = await load_api(kubeconfig)
        except KubeLookupError as exc:
            raise PoolDiscoveryError(f"KVPool {pool_ref}: cannot reach the Kubernetes API: {exc}") from None
        try:
            return await wait_for_pool_endpoints(api, namespace=namespace, pool=name,
                                                 timeout_seconds=timeout_seconds, poll_seconds=poll_seconds)
        finally:
            await api.close()

    # A thread of its own: asyncio.run refuses to start inside a thread whose loop is running.
    with concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="daybreak-discovery") as pool:
        return pool.submit(asyncio.run, run()).result()
