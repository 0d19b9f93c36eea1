"""The credential a deployment's engines get: a Secret per kvNamespace, minted by the pool's agents (pure).

The operator may not read Secrets, so it cannot derive ``namespace_credential(pool_secret, ns)`` itself;
the agents hold the pool secret and mint it (``daybreak.agent.credentials_minter``). Both sides agree on
the Secret's name through ``credential_secret_name``: the operator points the engines'
``DAYBREAK_POOL_TOKEN`` at it, the agents create it. One Secret per kvNamespace keeps a rolling upgrade
working: old and new pods reference different Secrets, each holding the credential of its own namespace.
"""

from __future__ import annotations

import hashlib

from daybreak.api import labels as vocab
from daybreak.api.base import GROUP, VERSION
from daybreak.pool.credentials import namespace_credential

SECRET_KEY = "token"  # the key inside the per-deployment Secret the engines mount as DAYBREAK_POOL_TOKEN
NAMESPACE_ANNOTATION = vocab.KV_NAMESPACE
CREDENTIAL_COMPONENT = "kv-credential"
_NAME_LIMIT = 253  # a Secret's name is a DNS subdomain


def credential_secret_name(pdd: str, kv_namespace: str) -> str:
    """``<pdd>-kv-<10 hex of sha256(kvNamespace)>``; a long PDDeployment name is cut, keeping the suffix."""
    suffix = "-kv-" + hashlib.sha256(kv_namespace.encode()).hexdigest()[:10]
    return pdd[: _NAME_LIMIT - len(suffix)].rstrip("-.") + suffix


def engine_credential_secret(*, pool_secret: bytes, kv_namespace: str, pdd: str, pdd_uid: str, namespace: str,
                             pool: str) -> dict[str, object]:
    """The Secret holding ``namespace_credential(pool_secret, kv_namespace)`` for one PDDeployment.

    Owned by the PDDeployment (garbage-collected with it) and immutable: the credential of a namespace
    never changes while the pool secret does not, and nobody, the minter included, may edit it later.
    """
    return {
        "apiVersion": "v1", "kind": "Secret", "type": "Opaque", "immutable": True,
        "metadata": {
            "name": credential_secret_name(pdd, kv_namespace), "namespace": namespace,
            "labels": {vocab.MANAGED_BY: "daybreak-agent",
                       vocab.COMPONENT: CREDENTIAL_COMPONENT,
                       vocab.DEPLOYMENT: pdd[:63].rstrip("-."), vocab.POOL: pool[:63].rstrip("-.")},
            "annotations": {NAMESPACE_ANNOTATION: kv_namespace},
            "ownerReferences": [{"apiVersion": f"{GROUP}/{VERSION}", "kind": vocab.PDDEPLOYMENT_KIND, "name": pdd,
                                 "uid": pdd_uid}],
        },
        "stringData": {SECRET_KEY: namespace_credential(pool_secret, kv_namespace)},
    }
