"""Where a Daybreak process gets its Kubernetes credentials: the one loader operator, agent and engines call.

Three processes talk to the API server (the operator, the node agent, engines
and routers through ``discovery.py``) and each used to pick its credentials
its own way. They agree now, first match wins:

1. ``kubeconfig`` when a path is given;
2. in a Pod (``KUBERNETES_SERVICE_HOST`` set), its ServiceAccount (token and CA under
   ``service_account_dir``; the projected token is re-read as the kubelet rotates it),
   even when ``$KUBECONFIG`` is set, so a stray variable cannot hand a Pod other rights;
3. ``$KUBECONFIG`` (the local process kubelet gives every pod one holding its
   ServiceAccount's token and sets no ``KUBERNETES_SERVICE_HOST``);
4. ``~/.kube/config`` (a developer's machine).

``kubeconfig=""`` means "no file": only the ServiceAccount. No source at all,
or an unreadable one, is a ``KubeConfigError`` that names it and what to set. Lives in
``client/`` because it is the lowest layer all three callers may import;
``kubernetes_asyncio`` is imported inside the function so ``import daybreak.client``
stays light.
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from daybreak.errors import DaybreakError

if TYPE_CHECKING:
    from kubernetes_asyncio.client import Configuration

SERVICE_ACCOUNT_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
DEFAULT_KUBECONFIG = "~/.kube/config"


class KubeConfigError(DaybreakError, RuntimeError):
    """No usable kubeconfig and no in-cluster ServiceAccount (or one of them is unreadable)."""


@dataclass(frozen=True)
class KubeConfig:
    """A loaded client configuration and where it came from."""

    configuration: Configuration
    in_cluster: bool
    default_namespace: str | None  # the kubeconfig context's namespace, or the Pod's own namespace
    token_path: str | None = None  # in cluster: the projected token, re-read on every refresh (it rotates)


async def load_kube_config(kubeconfig: str | None = None, *,
                           service_account_dir: str = SERVICE_ACCOUNT_DIR) -> KubeConfig:
    """Load credentials in the order of the module docstring; raises ``KubeConfigError`` with the cause."""
    from kubernetes_asyncio import client as k8s_client
    from kubernetes_asyncio import config as k8s_config

    configuration = k8s_client.Configuration()
    if kubeconfig == "" or (kubeconfig is None and "KUBERNETES_SERVICE_HOST" in os.environ):
        token_path = os.path.join(service_account_dir, "token")
        try:
            # try_refresh_token: the kubelet rotates the projected token; the loader re-reads it.
            k8s_config.load_incluster_config(client_configuration=configuration, try_refresh_token=True,
                                             token_filename=token_path,
                                             cert_filename=os.path.join(service_account_dir, "ca.crt"))
        except k8s_config.ConfigException as exc:
            raise KubeConfigError(
                f"no KUBECONFIG set and no in-cluster ServiceAccount ({exc}); "
                "set KUBECONFIG (or --kubeconfig) or run in a Pod") from None
        namespace = await asyncio.to_thread(_read_file, os.path.join(service_account_dir, "namespace"))
        return KubeConfig(configuration, in_cluster=True, default_namespace=namespace, token_path=token_path)
    path = kubeconfig or os.environ.get("KUBECONFIG", "") or _default_kubeconfig()
    if not kubeconfig and not os.environ.get("KUBECONFIG") and not await asyncio.to_thread(os.path.exists, path):
        raise KubeConfigError(f"no KUBECONFIG set, no in-cluster ServiceAccount (KUBERNETES_SERVICE_HOST unset) "
                              f"and no {path}; set KUBECONFIG (or --kubeconfig) or run in a Pod")
    try:
        loader = await k8s_config.load_kube_config(config_file=path, client_configuration=configuration)
    except (k8s_config.ConfigException, OSError, ValueError) as exc:
        raise KubeConfigError(f"kubeconfig {path}: {exc}; set KUBECONFIG (or --kubeconfig) to a readable "
                              "kubeconfig, or run in a Pod with a ServiceAccount") from exc
    context = loader.current_context  # a plain dict: {"name": ..., "context": {...}}
    namespace = (context.get("context") or {}).get("namespace") if isinstance(context, dict) else None
    return KubeConfig(configuration, in_cluster=False, default_namespace=namespace)


def _default_kubeconfig() -> str:
    return os.path.expanduser(DEFAULT_KUBECONFIG)


def _read_file(path: str) -> str | None:
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return f.read().strip() or None
