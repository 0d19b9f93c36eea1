"""Turn a resource model into a CustomResourceDefinition with a structural OpenAPI v3 schema.

pydantic writes JSON Schema (2020-12 flavour, ``$ref``s, ``anyOf`` with
``null`` for optional fields); the API server wants a *structural* OpenAPI v3
schema: every node typed, no references, no ``null`` branches, boolean
``exclusiveMinimum``. ``structural_schema`` converts one into the other and
``check_structural`` verifies the result, so a model that cannot be served
fails here rather than at ``kubectl apply``.

Status and kopf: the ``status`` object carries
``x-kubernetes-preserve-unknown-fields: true``. Without it the API server
prunes every status field the schema does not list, and kopf (which records
handler results under ``status.<handler-id>``) fails with "Patching failed
with inconsistencies". The known status fields stay fully typed; only unknown
keys are kept as they are. Status fields get no defaults: they are facts
written by the operator, not settings.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

from daybreak.api import labels
from daybreak.api.base import CustomResource
from daybreak.errors import DaybreakError

_TYPE_META_DOC = {
    "apiVersion": "APIVersion defines the versioned schema of this representation of an object.",
    "kind": "Kind is a string value representing the REST resource this object represents.",
}

# Output key order, for readable and stable YAML.
_KEY_ORDER = [
    "description", "type", "format", "enum", "default", "minimum", "exclusiveMinimum", "maximum",
    "exclusiveMaximum", "minLength", "maxLength", "pattern", "minItems", "maxItems", "anyOf", "items",
    "additionalProperties", "properties", "required",
]
_DROP = {"title"}


class SchemaError(DaybreakError, ValueError):
    """A model that cannot be expressed as a structural CRD schema."""


def _ref_name(ref: str) -> str:
    return ref.rsplit("/", 1)[-1]


def _description(text: str) -> str:
    # Docstrings wrap lines for the source's width; descriptions are prose, so
    # join wrapped lines but keep blank-line paragraph breaks.
    return re.sub(r"(?<!\n)\n(?!\n)", " ", text.strip())


def _ordered(node: dict[str, Any]) -> dict[str, Any]:
    rank = {key: i for i, key in enumerate(_KEY_ORDER)}
    return dict(sorted(node.items(), key=lambda kv: (rank.get(kv[0], len(rank)), kv[0])))


def _convert(node: dict[str, Any], defs: dict[str, Any], path: str) -> dict[str, Any]:
    node = dict(node)
    # Resolve references: the target's keys, overridden by the referring site's
    # (a field's own description and default win over the model's).
    if "$ref" in node:
        target = _convert(defs[_ref_name(node.pop("$ref"))], defs, path)
        node = {**target, **_convert(node, defs, path)}
    if "allOf" in node and len(node["allOf"]) == 1:
        target = _convert(node.pop("allOf")[0], defs, path)
        node = {**target, **_convert(node, defs, path)}
    if "anyOf" in node:
        branches = [b for b in node["anyOf"] if b != {"type": "null"}]
        if len(branches) == 1:
            # Optional[X]: an absent field is the API's "not set"; null is pruned by the server.
            del node["anyOf"]
            node = {**_convert(branches[0], defs, path), **_convert(node, defs, path)}
        else:
            node["anyOf"] = [_convert(b, defs, path) for b in branches]
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key in _DROP:
            continue
        if key == "default" and value is None:
            continue
        if key == "description":
            out[key] = _description(value)
        elif key == "properties":
            out[key] = {name: _convert(sub, defs, f"{path}.{name}") for name, sub in value.items()}
        elif key == "items":
            out[key] = _convert(value, defs, f"{path}[]")
        elif key == "additionalProperties":
            if isinstance(value, dict):
                out[key] = _convert(value, defs, f"{path}.*")
            elif value is True:
                raise SchemaError(f"{path}: free-form maps need an explicit value type or FreeForm")
            # additionalProperties: false (extra="forbid") is not allowed next to properties; pruning does that job.
        elif key in ("exclusiveMinimum", "exclusiveMaximum") and not isinstance(value, bool):
            # JSON Schema 2020-12 numeric form -> OpenAPI v3 boolean form.
            out["minimum" if key == "exclusiveMinimum" else "maximum"] = value
            out[key] = True
        elif key == "const":
            out["enum"] = [value]
        else:
            out[key] = value
    if out.get("x-kubernetes-int-or-string"):
        out.pop("type", None)
    if "properties" in out and "type" not in out:
        out["type"] = "object"
    return _ordered(out)


def _strip_defaults(node: dict[str, Any]) -> None:
    node.pop("default", None)
    for sub in node.get("properties", {}).values():
        _strip_defaults(sub)
    if isinstance(node.get("items"), dict):
        _strip_defaults(node["items"])
    if isinstance(node.get("additionalProperties"), dict):
        _strip_defaults(node["additionalProperties"])


def structural_schema(model: type[CustomResource]) -> dict[str, Any]:
    """The ``openAPIV3Schema`` of a resource model."""
    raw = model.model_json_schema(by_alias=True, mode="validation")
    defs = raw.pop("$defs", {})
    for name, doc in _TYPE_META_DOC.items():
        raw["properties"][name] = {"description": doc, "type": "string"}
    # Only name/generateName may be constrained in a CRD's metadata schema; the server owns the rest.
    raw["properties"]["metadata"] = {"type": "object"}
    root = _convert(raw, defs, "")
    props = root["properties"]
    if "status" in props:
        status = props["status"]
        _strip_defaults(status)
        if model.crd.preserve_unknown_status:
            status["x-kubernetes-preserve-unknown-fields"] = True
        props["status"] = _ordered(status)
    root["required"] = [name for name in ("spec",) if name in props]
    check_structural(root)
    return root


def _walk(node: dict[str, Any], path: str) -> Iterator[tuple[str, dict[str, Any]]]:
    yield path, node
    for name, sub in node.get("properties", {}).items():
        yield from _walk(sub, f"{path}.{name}" if path else name)
    if isinstance(node.get("items"), dict):
        yield from _walk(node["items"], f"{path}[]")
    if isinstance(node.get("additionalProperties"), dict):
        yield from _walk(node["additionalProperties"], f"{path}.*")


def walk(schema: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    """Every (dotted path, node) of a schema, root first, in field order."""
    yield from _walk(schema, "")


_ALLOWED_KEYS = set(_KEY_ORDER) | {
    "x-kubernetes-int-or-string", "x-kubernetes-preserve-unknown-fields", "x-kubernetes-validations",
    "x-kubernetes-list-type", "x-kubernetes-list-map-keys", "x-kubernetes-map-type", "x-kubernetes-embedded-resource",
    "uniqueItems", "nullable", "multipleOf",
}
_INT_OR_STRING_BRANCHES = [{"type": "integer"}, {"type": "string"}]


def check_structural(schema: dict[str, Any]) -> None:
    """Raise ``SchemaError`` where the schema breaks the API server's structural rules."""
    problems: list[str] = []
    for path, node in walk(schema):
        where = path or "<root>"
        unknown = set(node) - _ALLOWED_KEYS
        if unknown:
            problems.append(f"{where}: keys not allowed in a CRD schema: {sorted(unknown)}")
        int_or_string = node.get("x-kubernetes-int-or-string") is True
        if int_or_string:
            if node.get("anyOf") != _INT_OR_STRING_BRANCHES or "type" in node:
                problems.append(f"{where}: int-or-string must be exactly anyOf [integer, string] without type")
        elif "anyOf" in node:
            problems.append(f"{where}: anyOf is only allowed for int-or-string")
        if "type" not in node and not int_or_string and not node.get("x-kubernetes-preserve-unknown-fields"):
            problems.append(f"{where}: no type")
        if "properties" in node and "additionalProperties" in node:
            problems.append(f"{where}: properties and additionalProperties are mutually exclusive")
        if node.get("type") == "array" and "items" not in node:
            problems.append(f"{where}: array without items")
        for key in node.get("required", []):
            if key not in node.get("properties", {}):
                problems.append(f"{where}: required field {key!r} has no schema")
        exempt = path in ("", "metadata") or path.endswith(("[]", ".*"))
        if not exempt and not node.get("description"):
            problems.append(f"{where}: no description (write a docstring for the field)")
    if problems:
        raise SchemaError("schema is not structural:\n  " + "\n  ".join(problems))


def crd_document(model: type[CustomResource]) -> dict[str, Any]:
    """The full ``apiextensions.k8s.io/v1`` CustomResourceDefinition for a resource model."""
    info = model.crd
    names: dict[str, Any] = {
        "kind": info.kind,
        "listKind": f"{info.kind}List",
        "plural": info.plural,
        "singular": info.singular,
    }
    if info.short_names:
        names["shortNames"] = list(info.short_names)
    if info.categories:
        names["categories"] = list(info.categories)
    version: dict[str, Any] = {
        "name": info.version,
        "served": True,
        "storage": True,
        "subresources": {"status": {}},
    }
    if info.printer_columns:
        version["additionalPrinterColumns"] = [column.to_schema() for column in info.printer_columns]
    version["schema"] = {"openAPIV3Schema": structural_schema(model)}
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": info.name,
            "labels": {labels.NAME: "daybreak", labels.PART_OF: "daybreak"},
        },
        "spec": {
            "group": info.group,
            "names": names,
            "scope": info.scope,
            "versions": [version],
        },
    }
