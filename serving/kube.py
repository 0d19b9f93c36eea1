"""Read-only Kubernetes access for serving components: where the pool's agents and the role pods are.

There is no cluster DNS or kube-proxy on the local cluster, and a real cluster
may not want them on the data path either, so engines and the router find
their peers through the API: the KVPool's published ``status.endpoints`` and
the role Services' EndpointSlices (ready endpoints only). Credentials come from
``KUBECONFIG`` when set (the local process kubelet writes one per pod) and from
the pod's ServiceAccount otherwise.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

from kubernetes_asyncio import client as k8s_client
from kubernetes_asyncio import config as k8s_config

log = logging.getLogger(__name__)


async def load_api(kubeconfig: str | None = None) -> k8s_client.ApiClient:
    """An ApiClient from ``kubeconfig`` (default: ``$KUBECONFIG``), else the in-cluster ServiceAccount."""
    path = kubeconfig if kubeconfig is not None else os.environ.get("KUBECONFIG", "")
    configuration = k8s_client.Configuration()
    if path:
        await k8s_config.load_kube_config(config_file=path, client_configuration=configuration)
    else:
        k8s_config.load_incluster_config(client_configuration=configuration)
    return k8s_client.ApiClient(configuration)


async def get_json(api: k8s_client.ApiClient, path: str, *, query: Mapping[str, str] | None = None) -> Any:
    """GET ``path`` (e.g. ``/apis/daybreak.dev/v1alpha1/namespaces/ns/kvpools/p``) and return the decoded body."""
    response = await api.call_api(path, "GET", query_params=list((query or {}).items()),
                                  response_types_map={200: "object"}, auth_settings=["BearerToken"],
                                  _return_http_data_only=True)
    return response


async def pool_endpoints(api: k8s_client.ApiClient, *, namespace: str, pool: str) -> list[str]:
    """The ``host:port`` of every ready agent the operator published in the KVPool's status."""
    obj = await get_json(api, f"/apis/daybreak.dev/v1alpha1/namespaces/{namespace}/kvpools/{pool}")
    endpoints = (obj.get("status") or {}).get("endpoints") or []
    return [str(e) for e in endpoints]


async def ready_endpoints(api: k8s_client.ApiClient, *, namespace: str, service: str, port_name: str = "http"
                          ) -> list[str]:
    """``ip:port`` of the ready endpoints of ``service``, from its EndpointSlices."""
    body = await get_json(api, f"/apis/discovery.k8s.io/v1/namespaces/{namespace}/endpointslices",
                          query={"labelSelector": f"kubernetes.io/service-name={service}"})
    out: list[str] = []
    for item in body.get("items", []):
        ports = [p for p in item.get("ports") or [] if p.get("name", "") in (port_name, "")]
        if not ports:
            continue
        port = ports[0].get("port")
        for endpoint in item.get("endpoints") or []:
            if (endpoint.get("conditions") or {}).get("ready") is False:
                continue
            out.extend(f"{address}:{port}" for address in endpoint.get("addresses") or [])
    return sorted(set(out))
