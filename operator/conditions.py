"""Status conditions in the Kubernetes convention (metav1.Condition), merged without churning timestamps."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

TRUE = "True"
FALSE = "False"
UNKNOWN = "Unknown"


def now_rfc3339() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass(frozen=True)
class Condition:
    """One desired condition; ``reason`` is CamelCase and tells a human what to do next with ``message``."""

    type: str
    status: str
    reason: str
    message: str = ""


def merge(existing: list[dict[str, Any]] | None, desired: list[Condition], *, generation: int | None,
          now: str | None = None) -> list[dict[str, Any]]:
    """The new condition list: ``lastTransitionTime`` moves only when a condition's status changes.

    Conditions of other types already present (set by someone else) are kept as they are.
    """
    now = now or now_rfc3339()
    by_type = {c.get("type"): c for c in (existing or []) if isinstance(c, dict)}
    result: list[dict[str, Any]] = []
    for cond in desired:
        old = by_type.pop(cond.type, None)
        transition = old.get("lastTransitionTime") if old and old.get("status") == cond.status else None
        entry: dict[str, Any] = {"type": cond.type, "status": cond.status, "reason": cond.reason,
                                 "message": cond.message, "lastTransitionTime": transition or now}
        if generation is not None:
            entry["observedGeneration"] = generation
        result.append(entry)
    result.extend(by_type.values())
    return result


def find(conditions: list[dict[str, Any]] | None, type_: str) -> dict[str, Any] | None:
    for cond in conditions or []:
        if cond.get("type") == type_:
            return cond
    return None
