"""Metric names that cross a process boundary: one process exports them, another (the planner) reads them.

Declared once here, below both sides, so the router (``daybreak.serving``, which may not import the
operator) and the planner (``daybreak.operator.planner``) spell them the same way.
"""

from __future__ import annotations

HELD_REQUESTS = "daybreak_router_held_requests"
"""The router's gauge of requests it holds because no engine of a role is ready (label ``role``; the
planner sums the label sets): what starts a role at zero replicas again."""
