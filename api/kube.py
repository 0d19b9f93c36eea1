"""Kubernetes-shaped building blocks reused by Daybreak resources: quantities, conditions, tolerations, env.

These mirror the upstream core/v1 and meta/v1 types closely enough that
users can paste from Pod specs, and that the operator can copy them into the
children it creates without translation.
"""

from __future__ import annotations

import re
from datetime import datetime
from enum import StrEnum
from typing import Annotated, Any

from pydantic import AfterValidator, AwareDatetime, BeforeValidator, Field, WithJsonSchema

from daybreak.api.base import ApiModel
from daybreak.api.quantity import BYTES_PATTERN, QUANTITY_PATTERN, QuantityError, parse_bytes

_INT_OR_STRING: dict[str, Any] = {
    "anyOf": [{"type": "integer"}, {"type": "string"}],
    "x-kubernetes-int-or-string": True,
}


def _check_quantity(value: int | str) -> int | str:
    if isinstance(value, str) and re.fullmatch(QUANTITY_PATTERN, value) is None:
        raise QuantityError(f"{value!r} is not a Kubernetes quantity (examples: 500m, 2, 64Gi)")
    return value


def _check_percent_or_count(value: int | str) -> int | str:
    if isinstance(value, int) and value < 0:
        raise ValueError(f"must not be negative, got {value}")
    if isinstance(value, str) and re.fullmatch(PERCENT_PATTERN, value) is None:
        raise ValueError(f"{value!r} is neither a count nor a percentage like 25%")
    return value


PERCENT_PATTERN = r"^[0-9]{1,3}%$"

ByteQuantity = Annotated[
    int,
    BeforeValidator(parse_bytes),
    WithJsonSchema({**_INT_OR_STRING, "pattern": BYTES_PATTERN, "minimum": 0}),
]
"""A byte size: an integer or a quantity string such as ``64Gi``; held in Python as ``int`` bytes."""

Quantity = Annotated[
    int | str,
    AfterValidator(_check_quantity),
    WithJsonSchema({**_INT_OR_STRING, "pattern": QUANTITY_PATTERN}),
]
"""Any Kubernetes quantity (CPU ``500m``, memory ``8Gi``), kept as written for copying into Pod specs."""

PercentOrCount = Annotated[
    int | str,
    AfterValidator(_check_percent_or_count),
    WithJsonSchema({**_INT_OR_STRING, "pattern": PERCENT_PATTERN, "minimum": 0}),
]
"""A non-negative count (``1``) or a percentage of replicas (``25%``), as in Deployment rolling updates."""

FreeForm = Annotated[
    dict[str, Any],
    WithJsonSchema({"type": "object", "x-kubernetes-preserve-unknown-fields": True}),
]
"""An object passed through untouched (for example a partial Pod template)."""


class ConditionStatus(StrEnum):
    TRUE = "True"
    FALSE = "False"
    UNKNOWN = "Unknown"


class Condition(ApiModel):
    """One observation of the object's state, in the shape of meta/v1 Condition."""

    type: str = Field(min_length=1, max_length=316)
    """Condition type: Ready, Progressing or Degraded."""
    status: ConditionStatus
    """True, False or Unknown."""
    reason: str | None = Field(default=None, max_length=1024)
    """One CamelCase word a program can match on (PoolNotFound, AgentsNotReady, ...)."""
    message: str | None = Field(default=None, max_length=32768)
    """What happened and, when something is wrong, what to do about it."""
    last_transition_time: AwareDatetime | None = None
    """When the status last changed."""
    observed_generation: int | None = Field(default=None, ge=0)
    """The metadata.generation this condition was computed from."""


def conditions_field() -> Any:
    """A ``conditions`` list keyed by ``type`` (server-side apply merges per condition)."""
    return Field(
        default_factory=list,
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
    )


def set_condition(conditions: list[Condition], new: Condition, *, now: datetime) -> list[Condition]:
    """Return ``conditions`` with ``new`` merged in; lastTransitionTime only moves when the status changes."""
    out: list[Condition] = []
    replaced = False
    for old in conditions:
        if old.type != new.type:
            out.append(old)
            continue
        replaced = True
        keep_time = old.status == new.status and old.last_transition_time is not None
        out.append(new.model_copy(update={"last_transition_time": old.last_transition_time if keep_time else now}))
    if not replaced:
        out.append(new.model_copy(update={"last_transition_time": new.last_transition_time or now}))
    return out


class TolerationOperator(StrEnum):
    EXISTS = "Exists"
    EQUAL = "Equal"


class TaintEffect(StrEnum):
    NO_SCHEDULE = "NoSchedule"
    PREFER_NO_SCHEDULE = "PreferNoSchedule"
    NO_EXECUTE = "NoExecute"


class Toleration(ApiModel):
    """A core/v1 Toleration: lets the pods schedule onto nodes with a matching taint."""

    key: str | None = None
    """Taint key to match; empty with operator Exists matches every taint."""
    operator: TolerationOperator = TolerationOperator.EQUAL
    """Exists (any value) or Equal (value must match)."""
    value: str | None = None
    """Taint value to match when operator is Equal."""
    effect: TaintEffect | None = None
    """Taint effect to match; empty matches all effects."""
    toleration_seconds: int | None = None
    """For NoExecute: how long the pod stays bound after the taint appears."""


class ResourceRequirements(ApiModel):
    """Compute resources of a container (core/v1 ResourceRequirements without claims)."""

    limits: dict[str, Quantity] = Field(default_factory=dict)
    """Maximum amount of each resource, e.g. cpu: "4", memory: 8Gi, daybreak.dev/sunrise: 1."""
    requests: dict[str, Quantity] = Field(default_factory=dict)
    """Amount of each resource the scheduler reserves."""


class EnvVar(ApiModel):
    """A core/v1 EnvVar: a literal value or a reference (valueFrom)."""

    name: str = Field(min_length=1)
    """Variable name."""
    value: str | None = None
    """Literal value."""
    value_from: FreeForm | None = None
    """Source for the value (secretKeyRef, configMapKeyRef, fieldRef, resourceFieldRef), as in a Pod spec."""


def env_field() -> Any:
    """An ``env`` list keyed by ``name`` (like Pod env, so server-side apply merges per variable)."""
    return Field(
        default_factory=list,
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]},
    )


class LocalObjectReference(ApiModel):
    """A reference to an object in the same namespace, by name."""

    name: str = Field(min_length=1, max_length=253)
    """Name of the referenced object."""
