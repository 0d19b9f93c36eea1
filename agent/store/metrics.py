"""Prometheus metrics of one store: hits/misses per tier, bytes in/out and per transport, evictions, capacity, latency.

Each store owns a registry (not the process-global one), so several stores in
one test process never collide and ``/metrics`` shows exactly one agent.

Per-namespace usage carries a ``namespace`` label, kept to a bounded set: the
``NAMESPACE_SERIES`` namespaces storing or holding the most bytes in a tier get
their own series, the rest are summed under ``namespace="_other"``. A namespace
credential only reaches keys of its own namespace, so the namespaces present are
the ones the pool minted credentials for (plus what the pool secret wrote); the
cap keeps even a pool with thousands of them to a few dozen series per tier.
"""

from __future__ import annotations

from collections.abc import Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from daybreak.api import metrics as names

NAMESPACE_SERIES = 16   # namespaces with their own series per tier; the rest are summed as "_other"
OTHER_NAMESPACES = "_other"
_LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class StoreMetrics:
    """The store's metric families, all prefixed ``daybreak_store_``."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.hits = Counter(names.STORE_HITS, "Blocks found, by the tier they were served from", ["tier"],
                            registry=r)
        self.misses = Counter(names.STORE_MISSES, "Blocks asked for and not held by this agent", registry=r)
        self.bytes_in = Counter("daybreak_store_bytes_in", "Bytes written into a tier", ["tier"], registry=r)
        self.bytes_out = Counter(names.STORE_BYTES_OUT, "Bytes read out of a tier", ["tier"], registry=r)
        self.evictions = Counter("daybreak_store_evictions", "Blocks evicted (demoted or dropped) from a tier",
                                 ["tier"], registry=r)
        self.promotions = Counter("daybreak_store_promotions", "SSD blocks moved up to DRAM on a hit", registry=r)
        self.corrupt = Counter("daybreak_store_corrupt_blocks", "Blocks that failed their checksum and were removed",
                               registry=r)
        self.ssd_refused = Counter("daybreak_store_ssd_refused_blocks", "SSD block files refused, never adopted or "
                                   "served: header MAC of another key, another pool's directory, pre-MAC format",
                                   ["reason"], registry=r)
        self.capacity = Gauge("daybreak_store_capacity_bytes", "Capacity of a tier", ["tier"], registry=r)
        self.used = Gauge("daybreak_store_used_bytes", "Bytes in use in a tier", ["tier"], registry=r)
        self.latency = Histogram("daybreak_store_request_seconds", "Time to serve one request, by op", ["op"],
                                 buckets=_LATENCY_BUCKETS, registry=r)
        # One counter for every path a block's bytes take to or from this agent, counted where they move:
        # the store's stream (tcp, or tls when the listener wraps it), same-node memcpy through /dev/shm,
        # and the transfer engine's one-sided moves into or out of the registered segments.
        self.transport_bytes = Counter(names.STORE_BYTES, "Block bytes moved to (write) or from (read) this "
                                       "agent, by transport", ["transport", "op"], registry=r)
        self.rejected = Counter("daybreak_store_connections_rejected", "Connections closed for a protocol or auth error",
                                ["reason"], registry=r)

        self.namespace_bytes = Gauge("daybreak_store_namespace_bytes", "Bytes of one kvNamespace in a tier: stored, "
                                     "held (leases and uncommitted reservations) and pinned", ["tier", "namespace",
                                                                                              "kind"], registry=r)
        self.quota_refusals = Counter("daybreak_store_quota_refusals", "Requests refused for a namespace quota "
                                      "(held, pinned, pin_seconds, connections)", ["quota"], registry=r)
        self.fair_share_evictions = Counter("daybreak_store_fair_share_evictions", "Blocks evicted from the "
                                            "namespace furthest over its share of the tier", ["tier"], registry=r)

    def report_namespaces(self, usage: Mapping[tuple[str, str], tuple[int, int, int]]) -> None:
        """Publish (stored, held, pinned) bytes per (tier, namespace): the largest ``NAMESPACE_SERIES`` per tier."""
        rows: dict[tuple[str, str], list[int]] = {}
        for tier in {t for t, _ in usage}:
            ranked = sorted(((ns, v) for (t, ns), v in usage.items() if t == tier), key=lambda item: -sum(item[1]))
            for rank, (ns, values) in enumerate(ranked):
                label = ns if rank < NAMESPACE_SERIES and ns != OTHER_NAMESPACES else OTHER_NAMESPACES
                row = rows.setdefault((tier, label), [0, 0, 0])
                for i, value in enumerate(values):
                    row[i] += value
        self.namespace_bytes.clear()  # namespaces that left drop out instead of staying at their last value
        for (tier, ns), row_values in rows.items():
            for kind, value in zip(("stored", "held", "pinned"), row_values, strict=True):
                self.namespace_bytes.labels(tier=tier, namespace=ns, kind=kind).set(value)

    def moved(self, transport: str, op: str, nbytes: int) -> None:
        """Count ``nbytes`` of block data moved by ``transport`` (shm, tcp, tls, link, rdma); op read or write."""
        if nbytes:
            self.transport_bytes.labels(transport=transport, op=op).inc(nbytes)
