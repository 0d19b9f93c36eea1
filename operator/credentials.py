"""The credential a deployment's engines get: derived from the pool secret, scoped to its kvNamespace (pure)."""

from __future__ import annotations

from daybreak.pool.credentials import namespace_credential

SECRET_KEY = "token"  # the key inside the per-deployment Secret the engines mount as DAYBREAK_POOL_TOKEN


def engine_credential_secret(*, pool_secret: bytes, kv_namespace: str, name: str, namespace: str) -> dict[str, object]:
    """The per-PDDeployment Secret holding ``namespace_credential(pool_secret, kv_namespace)``.

    The operator creates it (owned by the PDDeployment) and points the engines' ``DAYBREAK_POOL_TOKEN``
    at it instead of the pool Secret, so an engine can reach only its own kvNamespace.
    """
    return {
        "apiVersion": "v1", "kind": "Secret", "type": "Opaque",
        "metadata": {"name": name, "namespace": namespace},
        "stringData": {SECRET_KEY: namespace_credential(pool_secret, kv_namespace)},
    }
