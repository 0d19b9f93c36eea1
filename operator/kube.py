"""Async Kubernetes REST access for the operator: config loading, raw requests and server-side apply.

One thin layer over ``kubernetes_asyncio``'s ``ApiClient`` (its auth, TLS and
token refresh) that speaks plain dicts, because the operator builds its
children as manifests and applies them with server-side apply, which the
generated typed APIs cannot express. Every call is a coroutine; NOTHING here
may block the event loop (kopf, the leader elector and the workers share it).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp
from kubernetes_asyncio import client as k8s_client
from kubernetes_asyncio.client.exceptions import ApiException

from daybreak.api import labels as vocab
from daybreak.client.kubeconfig import SERVICE_ACCOUNT_DIR, load_kube_config
from daybreak.errors import DaybreakError

logger = logging.getLogger(__name__)

FIELD_MANAGER = "daybreak-operator"
APPLY_CONTENT_TYPE = "application/apply-patch+yaml"
MERGE_CONTENT_TYPE = "application/merge-patch+json"

# Seconds for one request; a watch is kopf's business, not ours.
REQUEST_TIMEOUT = 15.0

Manifest = dict[str, Any]


@dataclass(frozen=True)
class ResourceKind:
    """Where a kind lives in the REST API."""

    group: str
    version: str
    plural: str
    kind: str
    namespaced: bool = True

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    def path(self, *, namespace: str | None = None, name: str | None = None, subresource: str | None = None) -> str:
        base = f"/apis/{self.group}/{self.version}" if self.group else f"/api/{self.version}"
        if self.namespaced and namespace:
            base += f"/namespaces/{namespace}"
        base += f"/{self.plural}"
        if name:
            base += f"/{name}"
            if subresource:
                base += f"/{subresource}"
        return base


CONFIGMAP = ResourceKind("", "v1", "configmaps", "ConfigMap")
SECRET = ResourceKind("", "v1", "secrets", "Secret")
SERVICE = ResourceKind("", "v1", "services", "Service")
SERVICEACCOUNT = ResourceKind("", "v1", "serviceaccounts", "ServiceAccount")
POD = ResourceKind("", "v1", "pods", "Pod")
EVENT = ResourceKind("", "v1", "events", "Event")
NODE = ResourceKind("", "v1", "nodes", "Node", namespaced=False)
NAMESPACE = ResourceKind("", "v1", "namespaces", "Namespace", namespaced=False)
DEPLOYMENT = ResourceKind("apps", "v1", "deployments", "Deployment")
DAEMONSET = ResourceKind("apps", "v1", "daemonsets", "DaemonSet")
STATEFULSET = ResourceKind("apps", "v1", "statefulsets", "StatefulSet")
ROLE = ResourceKind("rbac.authorization.k8s.io", "v1", "roles", "Role")
ROLEBINDING = ResourceKind("rbac.authorization.k8s.io", "v1", "rolebindings", "RoleBinding")
CLUSTERROLE = ResourceKind("rbac.authorization.k8s.io", "v1", "clusterroles", "ClusterRole", namespaced=False)
CLUSTERROLEBINDING = ResourceKind("rbac.authorization.k8s.io", "v1", "clusterrolebindings", "ClusterRoleBinding",
                                  namespaced=False)
LEASE = ResourceKind("coordination.k8s.io", "v1", "leases", "Lease")
KVPOOL = ResourceKind(vocab.GROUP, vocab.VERSION, vocab.KVPOOL_PLURAL, vocab.KVPOOL_KIND)
PDDEPLOYMENT = ResourceKind(vocab.GROUP, vocab.VERSION, vocab.PDDEPLOYMENT_PLURAL, vocab.PDDEPLOYMENT_KIND)
KVNODE = ResourceKind(vocab.GROUP, vocab.VERSION, vocab.KVNODE_PLURAL, vocab.KVNODE_KIND, namespaced=False)

KINDS: dict[str, ResourceKind] = {
    k.kind: k for k in (CONFIGMAP, SECRET, SERVICE, SERVICEACCOUNT, POD, EVENT, NODE, NAMESPACE, DEPLOYMENT,
                        DAEMONSET, STATEFULSET, ROLE, ROLEBINDING, CLUSTERROLE, CLUSTERROLEBINDING, LEASE,
                        KVPOOL, PDDEPLOYMENT, KVNODE)
}


def kind_of(manifest: Mapping[str, Any]) -> ResourceKind:
    """The ResourceKind of a manifest, from its ``kind`` (raises KeyError naming an unknown kind)."""
    try:
        return KINDS[manifest["kind"]]
    except KeyError:
        raise KeyError(f"kind {manifest.get('kind')!r} is not known to the operator's client") from None


class KubeError(DaybreakError):
    """An API call failed: ``status`` is the HTTP status, or 0 when the apiserver could not be reached."""

    def __init__(self, *, status: int, reason: str, message: str, method: str = "", path: str = "") -> None:
        self.status = status
        self.reason = reason
        self.message = message
        self.method = method
        self.path = path
        super().__init__(f"{method} {path}: {status} {reason}: {message}".strip())

    @property
    def not_found(self) -> bool:
        return self.status == 404

    @property
    def conflict(self) -> bool:
        return self.status == 409

    @property
    def retriable(self) -> bool:
        """Worth retrying as is: unreachable, throttled, timed out or a server-side failure."""
        return self.status == 0 or self.status == 429 or self.status >= 500


@dataclass(frozen=True)
class Credentials:
    """What kopf's login handler and our client need, taken from the loaded configuration."""

    server: str
    ca_path: str | None
    certificate_path: str | None
    private_key_path: str | None
    token: str | None
    insecure: bool
    default_namespace: str | None
    in_cluster: bool
    token_path: str | None = None  # in cluster: the projected token, re-read on every login (it rotates)


async def load_configuration(kubeconfig: str | None, *, service_account_dir: str = SERVICE_ACCOUNT_DIR,
                             ) -> tuple[k8s_client.Configuration, Credentials]:
    """Load credentials the way every Daybreak process does (``daybreak.client.kubeconfig``): the given file,
    else $KUBECONFIG, else, in a Pod, the ServiceAccount mounted at ``service_account_dir``, else
    ~/.kube/config; and the same as ``Credentials`` for kopf's login."""
    loaded = await load_kube_config(kubeconfig, service_account_dir=service_account_dir)
    configuration, in_cluster = loaded.configuration, loaded.in_cluster
    default_namespace, token_path = loaded.default_namespace, loaded.token_path
    token = None
    auth = (configuration.api_key or {}).get("BearerToken") or (configuration.api_key or {}).get("authorization")
    if auth:
        token = auth.removeprefix("Bearer ").strip()
    creds = Credentials(
        server=str(configuration.host or ""),
        ca_path=configuration.ssl_ca_cert,
        certificate_path=configuration.cert_file,
        private_key_path=configuration.key_file,
        token=token,
        insecure=not configuration.verify_ssl,
        default_namespace=default_namespace,
        in_cluster=in_cluster,
        token_path=token_path,
    )
    return configuration, creds


class KubeClient:
    """Plain-dict access to the API server; one instance per process, shared by every coroutine."""

    def __init__(self, configuration: k8s_client.Configuration, *, connections: int = 32) -> None:
        configuration.connection_pool_maxsize = connections
        self._api = k8s_client.ApiClient(configuration)
        self._api.user_agent = "daybreak-operator"

    async def close(self) -> None:
        await self._api.close()

    async def request(self, method: str, path: str, *, query: Mapping[str, Any] | None = None,
                      body: Any = None, content_type: str = "application/json",
                      request_timeout: float = REQUEST_TIMEOUT) -> Any:
        """One REST call; returns the decoded JSON body (or None) and raises KubeError on failure."""
        headers = {"Content-Type": content_type, "Accept": "application/json"}
        try:
            result = await self._api.call_api(
                path, method,
                query_params=[(k, v) for k, v in (query or {}).items() if v is not None],
                header_params=headers, body=body,
                response_types_map={200: "object", 201: "object", 202: "object"},
                auth_settings=["BearerToken"], _return_http_data_only=True,
                _request_timeout=request_timeout,
            )
        except ApiException as exc:
            raise _error_from(exc, method=method, path=path) from None
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            raise KubeError(status=0, reason=type(exc).__name__, message=str(exc) or "unreachable",
                            method=method, path=path) from None
        return result

    # -- verbs ----------------------------------------------------------------------
    async def get(self, kind: ResourceKind, name: str, *, namespace: str | None = None,
                  subresource: str | None = None) -> Manifest:
        return dict(await self.request("GET", kind.path(namespace=namespace, name=name, subresource=subresource)))

    async def get_or_none(self, kind: ResourceKind, name: str, *, namespace: str | None = None) -> Manifest | None:
        try:
            return await self.get(kind, name, namespace=namespace)
        except KubeError as exc:
            if exc.not_found:
                return None
            raise

    async def list(self, kind: ResourceKind, *, namespace: str | None = None, label_selector: str | None = None,
                   field_selector: str | None = None) -> list[Manifest]:
        result = await self.request("GET", kind.path(namespace=namespace),
                                    query={"labelSelector": label_selector, "fieldSelector": field_selector})
        return list(result.get("items") or [])

    async def create(self, kind: ResourceKind, manifest: Manifest, *, namespace: str | None = None,
                     dry_run: bool = False) -> Manifest:
        """POST; ``dry_run`` runs validation and admission and stores nothing (an existing name still gives 409)."""
        return dict(await self.request("POST", kind.path(namespace=namespace), body=manifest,
                                       query={"fieldManager": FIELD_MANAGER, "dryRun": "All" if dry_run else None}))

    async def replace(self, kind: ResourceKind, manifest: Manifest, *, namespace: str | None = None) -> Manifest:
        name = manifest["metadata"]["name"]
        return dict(await self.request("PUT", kind.path(namespace=namespace, name=name), body=manifest,
                                       query={"fieldManager": FIELD_MANAGER}))

    async def apply(self, manifest: Manifest, *, field_manager: str = FIELD_MANAGER,
                    force: bool = True) -> tuple[Manifest, bool]:
        """Server-side apply ``manifest``; returns the live object and whether it was created."""
        kind = kind_of(manifest)
        meta = manifest["metadata"]
        path = kind.path(namespace=meta.get("namespace"), name=meta["name"])
        # JSON is YAML: the apply-patch content type takes it as is.
        headers_query = {"fieldManager": field_manager, "force": "true" if force else None}
        try:
            result, status, _ = await self._api.call_api(
                path, "PATCH", query_params=[(k, v) for k, v in headers_query.items() if v is not None],
                header_params={"Content-Type": APPLY_CONTENT_TYPE, "Accept": "application/json"},
                body=json.loads(json.dumps(manifest)),
                response_types_map={200: "object", 201: "object"}, auth_settings=["BearerToken"],
                _return_http_data_only=False, _request_timeout=REQUEST_TIMEOUT,
            )
        except ApiException as exc:
            raise _error_from(exc, method="APPLY", path=path) from None
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            raise KubeError(status=0, reason=type(exc).__name__, message=str(exc) or "unreachable",
                            method="APPLY", path=path) from None
        return dict(result), status == 201

    async def patch_merge(self, kind: ResourceKind, name: str, body: Manifest, *, namespace: str | None = None,
                          subresource: str | None = None) -> Manifest:
        return dict(await self.request("PATCH", kind.path(namespace=namespace, name=name, subresource=subresource),
                                       body=body, content_type=MERGE_CONTENT_TYPE,
                                       query={"fieldManager": FIELD_MANAGER}))

    async def delete(self, kind: ResourceKind, name: str, *, namespace: str | None = None,
                     propagation: str = "Background") -> bool:
        """Delete; returns False when it was already gone."""
        try:
            await self.request("DELETE", kind.path(namespace=namespace, name=name),
                               body={"kind": "DeleteOptions", "apiVersion": "v1",
                                     "propagationPolicy": propagation})
        except KubeError as exc:
            if exc.not_found:
                return False
            raise
        return True


def _error_from(exc: ApiException, *, method: str, path: str) -> KubeError:
    reason = str(exc.reason or "")
    message = ""
    raw = exc.body
    text = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else str(raw or "")
    if text:
        try:
            status = json.loads(text)
            message = status.get("message", "") if isinstance(status, dict) else text
            reason = (status.get("reason") or reason) if isinstance(status, dict) else reason
        except ValueError:
            message = text[:500]
    return KubeError(status=int(exc.status or 0), reason=reason, message=message, method=method, path=path)
