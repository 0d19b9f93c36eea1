"""Read-only Kubernetes access for serving components: where the role pods are, and their kvNamespaces.

There is no cluster DNS or kube-proxy on the local cluster, and a real cluster
may not want them on the data path either, so the router finds the engines
through the API: the role Services' EndpointSlices (ready endpoints only; on
the local cluster, whose loopback pod IPs the API server refuses in slices,
the Ready pods the Service selects). Finding the pool's agents (the KVPool's
``status.endpoints``), the API client and its credentials are the client
library's (``daybreak.client.discovery``), re-exported here. Every call is a
coroutine with a timeout; nothing here blocks the event loop.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

# Pool discovery is the client library's (any engine needs it); re-exported for the router and the sim engine.
from daybreak.api.labels import KV_NAMESPACE
from daybreak.client.discovery import (
    REQUEST_TIMEOUT,
    SERVICE_ACCOUNT_DIR,
    KubeLookupError,
    endpoints_from_pool,
    get_json,
    load_api,
    pool_endpoints,
)
from daybreak.client.discovery import join_host_port as _join
from daybreak.client.kubewatch import WATCH_SECONDS

if TYPE_CHECKING:
    from kubernetes_asyncio.client import ApiClient

__all__ = [
    "KV_NAMESPACE_LABEL", "REQUEST_TIMEOUT", "SERVICE_ACCOUNT_DIR", "KubeLookupError", "endpoints_from_pods",
    "endpoints_from_pool", "endpoints_from_slices", "get_json", "load_api", "namespaces_of", "pod_kv_namespaces",
    "pod_namespace_index", "pool_endpoints", "ready_endpoints", "watch_endpoint_slices",
]


def endpoints_from_slices(body: Mapping[str, Any], *, port_name: str = "http") -> list[str]:
    """``ip:port`` of the ready endpoints in an EndpointSliceList (pure, so it is tested without a cluster).

    ``conditions.ready`` unset counts as ready (the API's documented meaning: unknown, serve it);
    a slice without a port named ``port_name`` (or an unnamed one) contributes nothing.
    """
    out: set[str] = set()
    for item in body.get("items") or []:
        ports = [p for p in item.get("ports") or [] if (p.get("name") or "") in (port_name, "")]
        if not ports or not isinstance(ports[0].get("port"), int):
            continue
        port = int(ports[0]["port"])
        for endpoint in item.get("endpoints") or []:
            if (endpoint.get("conditions") or {}).get("ready") is False:
                continue
            addresses = endpoint.get("addresses") or []
            if addresses:
                # Several addresses of one endpoint are the same pod (dual stack): dial one.
                out.add(_join(str(addresses[0]), port))
    return sorted(out)


def endpoints_from_pods(service: Mapping[str, Any], pods: Mapping[str, Any], *, port_name: str = "http"
                        ) -> list[str]:
    """``podIP:port`` of the Ready, not-terminating pods of a PodList, on ``service``'s ``port_name`` port.

    The port is the Service port's ``targetPort``: a number as is, a name looked up among each pod's
    container ports (so pods of one Service may listen on different numbers, as on the local cluster).
    """
    ports = [p for p in (service.get("spec") or {}).get("ports") or [] if (p.get("name") or "") in (port_name, "")]
    if not ports:
        return []
    target = ports[0].get("targetPort", ports[0].get("port"))
    out: set[str] = set()
    for pod in pods.get("items") or []:
        meta, status = pod.get("metadata") or {}, pod.get("status") or {}
        if meta.get("deletionTimestamp") or not status.get("podIP"):
            continue
        ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or [])
        if not ready:
            continue
        port = target if isinstance(target, int) else None
        if isinstance(target, str):
            for container in (pod.get("spec") or {}).get("containers") or []:
                for cp in container.get("ports") or []:
                    if cp.get("name") == target and isinstance(cp.get("containerPort"), int):
                        port = cp["containerPort"]
        if port:
            out.add(_join(str(status["podIP"]), int(port)))
    return sorted(out)


KV_NAMESPACE_LABEL = KV_NAMESPACE


def namespaces_of(addresses: list[str], labels: Mapping[str, str]) -> dict[str, str | None]:
    """``host:port`` -> its pod's kvNamespace, from ``pod_namespace_index`` (None where unknown)."""
    out: dict[str, str | None] = {}
    for address in addresses:
        host = address.rpartition(":")[0].strip("[]")
        out[address] = labels.get(address) or labels.get(host)
    return out


def pod_namespace_index(pods: Mapping[str, Any]) -> dict[str, str]:
    """``ip:containerPort`` and ``ip`` -> ``daybreak.dev/kv-namespace`` label, from a PodList.

    On the local cluster several pods share one loopback IP and differ by port, so the port-qualified
    key comes first; a bare IP whose pods disagree is left out rather than guessed.
    """
    out: dict[str, str] = {}
    by_ip: dict[str, set[str]] = {}
    for pod in pods.get("items") or []:
        ip = (pod.get("status") or {}).get("podIP")
        label = ((pod.get("metadata") or {}).get("labels") or {}).get(KV_NAMESPACE_LABEL)
        if not ip or not label:
            continue
        by_ip.setdefault(str(ip), set()).add(str(label))
        for container in (pod.get("spec") or {}).get("containers") or []:
            for cp in container.get("ports") or []:
                if isinstance(cp.get("containerPort"), int):
                    out[_join(str(ip), cp["containerPort"])] = str(label)
    out.update({ip: next(iter(found)) for ip, found in by_ip.items() if len(found) == 1})
    return out


async def pod_kv_namespaces(api: ApiClient, *, namespace: str) -> dict[str, str]:
    """``pod_namespace_index`` of the pods in ``namespace`` that carry the kvNamespace label."""
    pods = await get_json(api, f"/api/v1/namespaces/{namespace}/pods", query={"labelSelector": KV_NAMESPACE_LABEL})
    return pod_namespace_index(pods)


async def ready_endpoints(api: ApiClient, *, namespace: str, service: str, port_name: str = "http"
                          ) -> list[str]:
    """``ip:port`` of the ready endpoints of ``service``: its EndpointSlices, else its Ready pods.

    The API server refuses loopback addresses in EndpointSlices (127.0.0.0/8, ::1), so on the local
    cluster, where every pod has a loopback IP, the Service has no usable slices; the same answer then
    comes from the pods its selector picks, with their Ready condition (what the slices would list).
    On a real cluster the slices answer and the pods are never listed.
    """
    body = await get_json(api, f"/apis/discovery.k8s.io/v1/namespaces/{namespace}/endpointslices",
                          query={"labelSelector": f"kubernetes.io/service-name={service}"})
    found = endpoints_from_slices(body, port_name=port_name)
    if found:
        return found
    try:
        svc = await get_json(api, f"/api/v1/namespaces/{namespace}/services/{service}")
    except KubeLookupError as exc:
        if exc.status == 404:
            return []  # no such Service (yet): nothing to route to
        if exc.status == 403:
            # No right to the loopback fallback (a real cluster's Role grants none): the slices' answer
            # stands. Raising would keep the last list, so a role scaled to zero kept its gone pods listed.
            return found
        raise
    selector = (svc.get("spec") or {}).get("selector") or {}
    if not selector:
        return []
    pods = await get_json(api, f"/api/v1/namespaces/{namespace}/pods",
                          query={"labelSelector": ",".join(f"{k}={v}" for k, v in sorted(selector.items()))})
    return endpoints_from_pods(svc, pods, port_name=port_name)


async def watch_endpoint_slices(api: ApiClient, *, namespace: str, service: str, on_event: Callable[[], None],
                                timeout_seconds: int = WATCH_SECONDS) -> None:
    """One watch of ``service``'s EndpointSlices: ``on_event()`` at every event (the first ones: the slices
    that exist), a clean return when the server closes it, an exception when it fails.

    It says only *that* the ready endpoints may have changed; ``ready_endpoints`` says which they are, so a
    missed or reordered event costs a re-read, never a wrong list.
    """
    from kubernetes_asyncio import client as k8s_client
    from kubernetes_asyncio import watch as k8s_watch

    slices = k8s_client.DiscoveryV1Api(api)
    async with k8s_watch.Watch().stream(
        slices.list_namespaced_endpoint_slice, namespace,
        label_selector=f"kubernetes.io/service-name={service}", timeout_seconds=timeout_seconds,
    ) as stream:
        async for event in stream:
            if event.get("type") == "ERROR":
                path = f"/apis/discovery.k8s.io/v1/namespaces/{namespace}/endpointslices?watch=1"
                raise KubeLookupError(path, status=0, message=str(event.get("raw_object") or event.get("object")))
            on_event()
