"""Prometheus metrics of the operator and the HTTP endpoint that serves them (/metrics, /healthz).

The endpoint runs in prometheus-client's own daemon thread, not on the event
loop: scraping never waits behind a reconcile, and kopf's task reaper (which
cancels every task created while it runs) never touches it.
"""

from __future__ import annotations

import logging

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    disable_created_metrics,
    start_http_server,
)

from daybreak.api import metrics as names

logger = logging.getLogger(__name__)

disable_created_metrics()  # no *_created series: they double the scrape for no operational value
REGISTRY = CollectorRegistry(auto_describe=True)
ProcessCollector(registry=REGISTRY)  # process_resident_memory_bytes and friends
PlatformCollector(registry=REGISTRY)
GCCollector(registry=REGISTRY)

RECONCILES = Counter(
    names.total(names.OPERATOR_RECONCILES),
    "Reconciles finished, by resource kind and result (success, error, waiting).",
    ["kind", "result"], registry=REGISTRY,
)
RECONCILE_DURATION = Histogram(
    "daybreak_operator_reconcile_duration_seconds",
    "Wall time of one reconcile, by resource kind.",
    ["kind"], registry=REGISTRY,
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0),
)
CHILDREN_APPLIED = Counter(
    "daybreak_operator_children_applied_total",
    "Children server-side applied, by child kind and outcome (created, updated, unchanged).",
    ["kind", "outcome"], registry=REGISTRY,
)
API_ERRORS = Counter(
    names.total(names.OPERATOR_APISERVER_ERRORS),
    "Failed API calls made by reconciles, by HTTP status (0: unreachable).",
    ["status"], registry=REGISTRY,
)
LEADER = Gauge(
    "daybreak_operator_leader",
    "1 while this process holds the leader Lease and reconciles, else 0.",
    registry=REGISTRY,
)
LEADER_TRANSITIONS = Counter(
    "daybreak_operator_leader_transitions_total",
    "Times this process became leader.",
    registry=REGISTRY,
)
QUEUE_DEPTH = Gauge(
    "daybreak_operator_queue_depth",
    "Objects waiting to be reconciled.",
    registry=REGISTRY,
)
ROLE_REPLICAS = Gauge(
    "daybreak_operator_role_replicas",
    "Replicas the operator applied to a PDDeployment's role (prefill, decode, router).",
    ["namespace", "deployment", "role"], registry=REGISTRY,
)
SCALE_EVENTS = Counter(
    "daybreak_operator_scale_events_total",
    "Replica changes applied to a role, by direction (up, down): the planner's decisions as carried out.",
    ["namespace", "deployment", "role", "direction"], registry=REGISTRY,
)

PLANNER_INPUT = Gauge(
    "daybreak_planner_input",
    "The planner's inputs and estimates per role, by name (arrival_rate, uncached_tokens, ttft_p90_s, "
    "itl_mean_s, tokens_per_s, pods, ...), as of its last interval.",
    ["namespace", "deployment", "role", "input"], registry=REGISTRY,
)
PLANNER_REPLICAS = Gauge(
    "daybreak_planner_replicas",
    "Replicas per role as the planner saw and decided them (kind: current, recommended, desired).",
    ["namespace", "deployment", "role", "kind"], registry=REGISTRY,
)
PLANNER_DECISIONS = Counter(
    "daybreak_planner_scale_decisions_total",
    "Replica changes the planner made, by role and direction (up, down).",
    ["namespace", "deployment", "role", "direction"], registry=REGISTRY,
)
PLANNER_SCRAPE_FAILURES = Counter(
    "daybreak_planner_scrape_failures_total",
    "Engine pods whose /metrics could not be read in an interval (they count as silent, not idle).",
    ["namespace", "deployment", "role"], registry=REGISTRY,
)
CACHE_FLUSHED_BYTES = Counter(
    "daybreak_operator_cache_flushed_bytes_total",
    "Bytes of retired kvNamespaces deleted from the pool (updateStrategy.cache: flush).",
    ["namespace", "deployment"], registry=REGISTRY,
)


def serve(port: int, *, address: str = "0.0.0.0") -> None:
    """Serve the registry on ``address:port`` from a daemon thread; port 0 disables it."""
    if port <= 0:
        return
    start_http_server(port, addr=address, registry=REGISTRY)
    logger.info("metrics serving address=%s port=%d path=/metrics", address, port)
