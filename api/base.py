"""The model kit every Daybreak resource is written in: camelCase wire names, CEL rules, CRD identity.

A resource is a pydantic model (``CustomResource`` subclass) whose class
docstring, field docstrings, types, defaults and constraints become the CRD
schema (see ``daybreak.api.schema``). Python code uses snake_case attributes;
the wire (Kubernetes) uses the camelCase aliases. Cross-field rules are
declared next to the fields they compare, as ``__cel_rules__`` on the model,
and land in the schema as ``x-kubernetes-validations``.

Parsing is lenient about unknown fields (``extra="ignore"``) so an older
operator can read objects written against a newer schema; strictness about
unknown fields is the API server's job (``kubectl apply`` validates strictly).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Self

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic.alias_generators import to_camel

from daybreak.api.labels import API_VERSION, GROUP, VERSION  # re-exported: ``daybreak.api`` names them


@dataclass(frozen=True)
class CelRule:
    """One ``x-kubernetes-validations`` entry, evaluated by the API server on the object it is declared on.

    ``field_path`` (relative, e.g. ``.minReplicas``) is where the error is
    reported, so the message names the field a user must change. Avoid a
    ``message_expression`` that formats values: the API server estimates
    ``string(x)`` as unbounded and rejects the CRD for exceeding the CEL cost budget.
    """

    rule: str
    message: str
    field_path: str | None = None
    message_expression: str | None = None
    reason: str | None = None  # FieldValueInvalid (default), FieldValueRequired, FieldValueForbidden, ...
    # The same rule in Python, so objects built or parsed in Python obey it too
    # (tests check that every rule has one and that both sides reject the same manifests).
    check: Callable[[Any], bool] | None = field(default=None, compare=False, repr=False)

    def to_schema(self) -> dict[str, str]:
        out = {"rule": self.rule, "message": self.message}
        if self.message_expression:
            out["messageExpression"] = self.message_expression
        if self.field_path:
            out["fieldPath"] = self.field_path
        if self.reason:
            out["reason"] = self.reason
        return out


def _schema_extra(schema: dict[str, Any], cls: type[BaseModel]) -> None:
    rules: tuple[CelRule, ...] = getattr(cls, "__cel_rules__", ())
    if rules:
        schema["x-kubernetes-validations"] = [rule.to_schema() for rule in rules]


# Wire names that plain snake_case -> camelCase gets wrong. Kept here, not as
# per-field aliases, so constructors take the snake_case names under mypy too.
WIRE_NAME_EXCEPTIONS = {
    "num_kv_heads": "numKVHeads",  # not numKvHeads: KV is an acronym, as in kvLayout's docs
    "from_replicas": "from",  # status.lastScale.{from,to}; "from" is a Python keyword
    "to_replicas": "to",
}


def wire_name(name: str) -> str:
    """The camelCase field name Kubernetes objects use for a snake_case attribute."""
    return WIRE_NAME_EXCEPTIONS.get(name) or to_camel(name)


class ApiModel(BaseModel):
    """Base of every API object: camelCase aliases, docstrings as descriptions, CEL rules."""

    model_config = ConfigDict(
        alias_generator=wire_name,
        validate_by_name=True,
        validate_by_alias=True,
        serialize_by_alias=True,
        use_attribute_docstrings=True,
        extra="ignore",
        json_schema_extra=_schema_extra,
    )

    __cel_rules__: ClassVar[tuple[CelRule, ...]] = ()

    @model_validator(mode="after")
    def _check_cel_rules(self) -> Self:
        for rule in type(self).__cel_rules__:
            if rule.check is not None and not rule.check(self):
                where = f"{rule.field_path.lstrip('.')}: " if rule.field_path else ""
                raise ValueError(f"{where}{rule.message}")
        return self

    def to_dict(self) -> dict[str, Any]:
        """The wire form: camelCase keys, JSON types, unset optional fields left out (safe for merge patches)."""
        return self.model_dump(mode="json", by_alias=True, exclude_none=True)


def _without_empty(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _without_empty(v) for k, v in value.items() if v not in ({}, [])}
    return value


def nested(model: type[BaseModel]) -> Any:
    """A sub-object that defaults to itself with all its own defaults.

    The schema default is the whole defaulted object (not ``{}``): the API
    server checks a default against the object's CEL rules without applying
    the nested defaults first, so ``{}`` would fail rules such as
    ``lowWatermark < highWatermark``. ``kubectl get -o yaml`` then shows the
    effective settings.
    """
    default = _without_empty(model().model_dump(mode="json", by_alias=True, exclude_none=True))
    return Field(default_factory=model, json_schema_extra={"default": default})


def plain(value: Any) -> Any:
    """Deep-copy any Mapping/Sequence (kopf ``Body``, ``Spec`` views) into plain dicts and lists."""
    if isinstance(value, Mapping):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, Sequence) and not isinstance(value, str | bytes):
        return [plain(v) for v in value]
    return value


@dataclass(frozen=True)
class PrinterColumn:
    """One ``additionalPrinterColumns`` entry (what ``kubectl get`` shows)."""

    name: str
    json_path: str
    type: str = "string"  # integer | number | string | boolean | date
    description: str = ""
    priority: int = 0  # 0: always shown; 1: only with -o wide

    def to_schema(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, "type": self.type, "jsonPath": self.json_path}
        if self.description:
            out["description"] = self.description
        if self.priority:
            out["priority"] = self.priority
        return out


@dataclass(frozen=True)
class CRDInfo:
    """The identity of a resource kind: names, scope and how ``kubectl get`` prints it."""

    kind: str
    plural: str
    short_names: tuple[str, ...] = ()
    categories: tuple[str, ...] = ("daybreak",)
    scope: str = "Namespaced"  # or "Cluster"
    printer_columns: tuple[PrinterColumn, ...] = ()
    group: str = GROUP
    version: str = VERSION
    # Whether status gets x-kubernetes-preserve-unknown-fields (see schema.py for why).
    preserve_unknown_status: bool = True
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def singular(self) -> str:
        return self.kind.lower()

    @property
    def name(self) -> str:
        """The CRD object's name, ``<plural>.<group>``."""
        return f"{self.plural}.{self.group}"

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}"


class ObjectMeta(ApiModel):
    """The parts of Kubernetes object metadata Daybreak reads; everything else is kept as is."""

    model_config = ConfigDict(extra="allow")

    name: str | None = None
    """Object name, unique per namespace."""
    namespace: str | None = None
    """Namespace of the object."""
    uid: str | None = None
    """Server-assigned unique id (used in owner references)."""
    generation: int | None = None
    """Spec generation, bumped by the API server on every spec change."""
    resource_version: str | None = None
    """Opaque version for optimistic concurrency."""
    labels: dict[str, str] = Field(default_factory=dict)
    """Object labels."""
    annotations: dict[str, str] = Field(default_factory=dict)
    """Object annotations."""


class CustomResource(ApiModel):
    """A whole Daybreak object (apiVersion, kind, metadata, spec, status); subclasses set ``crd``."""

    crd: ClassVar[CRDInfo]

    api_version: str = API_VERSION
    """APIVersion of this object (``daybreak.dev/v1alpha1``)."""
    kind: str
    """Kind of this object."""
    metadata: ObjectMeta = Field(default_factory=ObjectMeta)
    """Standard object metadata."""

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> Self:
        """Parse a raw object as the API server or kopf hands it over (camelCase keys, any Mapping)."""
        return cls.model_validate(plain(body))


_DNS_LABEL = "^[a-z]([-a-z0-9]*[a-z0-9])?$"

DNS_LABEL_NAME_RULE = CelRule(
    rule=f"self.metadata.name.matches('{_DNS_LABEL}')",
    message="metadata.name must be a DNS-1035 label (lowercase letters, digits and '-', starting with a letter):"
    " it names the Services created for this object",
    check=lambda obj: obj.metadata.name is None or re.fullmatch(_DNS_LABEL, obj.metadata.name) is not None,
)
"""A root rule for kinds whose name becomes part of Service names (Services require DNS-1035 labels).

No fieldPath: the API server accepts only paths inside the schema, and the
CRD schema of metadata may not list fields; the message names the field.
"""
