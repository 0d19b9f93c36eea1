"""Prometheus metrics of one store: hits/misses per tier, bytes in/out and per transport, evictions, capacity, latency.

Each store owns a registry (not the process-global one), so several stores in
one test process never collide and ``/metrics`` shows exactly one agent.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class StoreMetrics:
    """The store's metric families, all prefixed ``daybreak_store_``."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.hits = Counter("daybreak_store_hits", "Blocks found, by the tier they were served from", ["tier"],
                            registry=r)
        self.misses = Counter("daybreak_store_misses", "Blocks asked for and not held by this agent", registry=r)
        self.bytes_in = Counter("daybreak_store_bytes_in", "Bytes written into a tier", ["tier"], registry=r)
        self.bytes_out = Counter("daybreak_store_bytes_out", "Bytes read out of a tier", ["tier"], registry=r)
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
        self.transport_bytes = Counter("daybreak_store_bytes", "Block bytes moved to (write) or from (read) this "
                                       "agent, by transport", ["transport", "op"], registry=r)
        self.rejected = Counter("daybreak_store_connections_rejected", "Connections closed for a protocol or auth error",
                                ["reason"], registry=r)

    def moved(self, transport: str, op: str, nbytes: int) -> None:
        """Count ``nbytes`` of block data moved by ``transport`` (shm, tcp, tls, link, rdma); op read or write."""
        if nbytes:
            self.transport_bytes.labels(transport=transport, op=op).inc(nbytes)
