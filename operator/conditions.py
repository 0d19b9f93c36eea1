"""Status conditions in the Kubernetes convention (metav1.Condition), merged without churning timestamps.

There is one ``Condition`` class, the API's (``daybreak.api.kube``); the
operator builds desired conditions with it and merges them into the raw status
dicts it writes.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from daybreak.api.kube import Condition, ConditionStatus

__all__ = ["FALSE", "TRUE", "UNKNOWN", "Condition", "ConditionStatus", "find", "merge", "now_rfc3339"]

TRUE = ConditionStatus.TRUE
FALSE = ConditionStatus.FALSE
UNKNOWN = ConditionStatus.UNKNOWN


def now_rfc3339() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


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
        entry: dict[str, Any] = {"type": cond.type, "status": str(cond.status), "reason": cond.reason or "",
                                 "message": cond.message or "", "lastTransitionTime": transition or now}
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
