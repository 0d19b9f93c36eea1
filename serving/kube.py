"""Read-only Kubernetes access for serving components: where the pool's agents and the role pods are.

There is no cluster DNS or kube-proxy on the local cluster, and a real cluster
may not want them on the data path either, so engines and the router find
their peers through the API: the KVPool's published ``status.endpoints`` and
the role Services' EndpointSlices (ready endpoints only; on the local cluster,
whose loopback pod IPs the API server refuses in slices, the Ready pods the
Service selects). Credentials come from
``KUBECONFIG`` when set (the local process kubelet writes one per pod) and from
the pod's ServiceAccount otherwise. Every call is a coroutine with a timeout;
nothing here blocks the event loop.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

import aiohttp
from kubernetes_asyncio import client as k8s_client
from kubernetes_asyncio import config as k8s_config
from kubernetes_asyncio.client.exceptions import ApiException

from daybreak.errors import DaybreakError

log = logging.getLogger(__name__)

SERVICE_ACCOUNT_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
# Seconds per API call: discovery refreshes about every second, so a slow call must not pile up.
REQUEST_TIMEOUT = 5.0


class KubeLookupError(DaybreakError):
    """An API read failed; ``status`` is the HTTP status, 0 when the API server was unreachable."""

    def __init__(self, path: str, *, status: int, message: str) -> None:
        self.status = status
        super().__init__(f"GET {path}: {status or 'unreachable'}: {message}")


async def load_api(kubeconfig: str | None = None, *, service_account_dir: str = SERVICE_ACCOUNT_DIR,
                   ) -> k8s_client.ApiClient:
    """An ApiClient from ``kubeconfig`` (default: ``$KUBECONFIG``), else the in-cluster ServiceAccount.

    Raises ``KubeLookupError`` (status 0) naming both sources when neither is there.
    """
    path = kubeconfig if kubeconfig is not None else os.environ.get("KUBECONFIG", "")
    configuration = k8s_client.Configuration()
    if path:
        await k8s_config.load_kube_config(config_file=path, client_configuration=configuration)
    else:
        token = os.path.join(service_account_dir, "token")
        try:
            # try_refresh_token: the kubelet rotates the projected token; the loader re-reads it.
            k8s_config.load_incluster_config(client_configuration=configuration, try_refresh_token=True,
                                             token_filename=token,
                                             cert_filename=os.path.join(service_account_dir, "ca.crt"))
        except k8s_config.ConfigException as exc:
            raise KubeLookupError("(config)", status=0, message=(
                f"no KUBECONFIG set and no in-cluster ServiceAccount ({exc}); set KUBECONFIG or run in a pod"
            )) from None
    api = k8s_client.ApiClient(configuration)
    api.user_agent = "daybreak-serving"
    return api


async def get_json(api: k8s_client.ApiClient, path: str, *, query: Mapping[str, str] | None = None,
                   timeout_seconds: float = REQUEST_TIMEOUT) -> Any:
    """GET ``path`` (e.g. ``/apis/daybreak.dev/v1alpha1/namespaces/ns/kvpools/p``) and return the decoded body."""
    try:
        return await api.call_api(path, "GET", query_params=list((query or {}).items()),
                                  header_params={"Accept": "application/json"},
                                  response_types_map={200: "object"}, auth_settings=["BearerToken"],
                                  _return_http_data_only=True, _request_timeout=timeout_seconds)
    except ApiException as exc:
        raise KubeLookupError(path, status=int(exc.status or 0), message=str(exc.reason or exc)) from None
    except (TimeoutError, aiohttp.ClientError, OSError) as exc:
        raise KubeLookupError(path, status=0, message=str(exc) or type(exc).__name__) from None


def endpoints_from_pool(obj: Mapping[str, Any]) -> list[str]:
    """``host:port`` of each ``status.endpoints`` entry (``{node, address, port, transports}``) of a KVPool."""
    out: set[str] = set()
    for entry in (obj.get("status") or {}).get("endpoints") or []:
        if not isinstance(entry, Mapping):
            continue
        address, port = entry.get("address"), entry.get("port")
        if isinstance(address, str) and address and isinstance(port, int) and 0 < port < 65536:
            out.add(_join(address, port))
    return sorted(out)


async def pool_endpoints(api: k8s_client.ApiClient, *, namespace: str, pool: str) -> list[str]:
    """The ``host:port`` of every ready agent the operator published in the KVPool's status."""
    return endpoints_from_pool(await get_json(api, f"/apis/daybreak.dev/v1alpha1/namespaces/{namespace}/kvpools/{pool}"))


def _join(address: str, port: int) -> str:
    return f"[{address}]:{port}" if ":" in address else f"{address}:{port}"


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


KV_NAMESPACE_LABEL = "daybreak.dev/kv-namespace"


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


async def pod_kv_namespaces(api: k8s_client.ApiClient, *, namespace: str) -> dict[str, str]:
    """``pod_namespace_index`` of the pods in ``namespace`` that carry the kvNamespace label."""
    pods = await get_json(api, f"/api/v1/namespaces/{namespace}/pods", query={"labelSelector": KV_NAMESPACE_LABEL})
    return pod_namespace_index(pods)


async def ready_endpoints(api: k8s_client.ApiClient, *, namespace: str, service: str, port_name: str = "http"
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
        raise
    selector = (svc.get("spec") or {}).get("selector") or {}
    if not selector:
        return []
    pods = await get_json(api, f"/api/v1/namespaces/{namespace}/pods",
                          query={"labelSelector": ",".join(f"{k}={v}" for k, v in sorted(selector.items()))})
    return endpoints_from_pods(svc, pods, port_name=port_name)
