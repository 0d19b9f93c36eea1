"""Shared models: the CRD types and wire definitions used by operator, agent and client (no I/O).

The resources (``KVPool``, ``PDDeployment``) are pydantic models whose
snake_case attributes map to the camelCase fields of the Kubernetes objects.
Parse a raw object with ``KVPool.from_body(body)``; produce the wire form
(defaults filled in) with ``.to_dict()``.
"""

from daybreak.api.base import API_VERSION, GROUP, VERSION, CustomResource
from daybreak.api.kube import Condition, ConditionStatus
from daybreak.api.kvcompat import EngineKind, KVDtype, KVLayout, KVPlatform, kv_namespace
from daybreak.api.kvpool import KVPool, KVPoolSpec, KVPoolStatus
from daybreak.api.pddeployment import PDDeployment, PDDeploymentSpec, PDDeploymentStatus, Role
from daybreak.api.quantity import QuantityError, format_bytes, parse_bytes, parse_quantity

__all__ = [
    "API_VERSION",
    "GROUP",
    "VERSION",
    "Condition",
    "ConditionStatus",
    "CustomResource",
    "EngineKind",
    "KVDtype",
    "KVLayout",
    "KVPlatform",
    "KVPool",
    "KVPoolSpec",
    "KVPoolStatus",
    "PDDeployment",
    "PDDeploymentSpec",
    "PDDeploymentStatus",
    "QuantityError",
    "Role",
    "format_bytes",
    "kv_namespace",
    "parse_bytes",
    "parse_quantity",
]
