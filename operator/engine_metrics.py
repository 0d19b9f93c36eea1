"""Parsing what the planner scrapes: engines' Prometheus text into samples and windows, the router's held gauge.

Inputs are the metrics every engine exposes under vLLM's names (the sim engine
writes the same ones), so one parser serves both. A /metrics body that is not
Prometheus text, or lacks vLLM's request gauges, is a ``MetricsError``: the
scraper counts that pod as silent, never as idle. No I/O (``metrics_scrape``
reads the pods).

COUNTERS ARE DELTAS: every rate comes from two samples of the same pod
(``window``); a counter that went down means the engine restarted, and that
pod has no window until its next sample.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from daybreak.api import metrics as names
from daybreak.errors import DaybreakError

# vLLM's metric names (counters also exposed with the _total suffix by prometheus_client).
# Declared once in api/metrics.py, where the sim engine's writers take them too.
RUNNING = names.VLLM_RUNNING
WAITING = names.VLLM_WAITING
TTFT = names.VLLM_TTFT
ITL = names.VLLM_ITL
ITL_OLD = names.VLLM_ITL_OLD
E2E = names.VLLM_E2E
PROMPT_TOKENS = names.VLLM_PROMPT_TOKENS
CACHE_QUERIES = names.VLLM_PREFIX_CACHE_QUERIES
CACHE_HITS = names.VLLM_PREFIX_CACHE_HITS
EXTERNAL_HITS = names.VLLM_EXTERNAL_PREFIX_CACHE_HITS  # tokens found through the KV connector (the pool)
KV_USAGE = names.VLLM_KV_USAGE
# Engine-local cache value the pool does not hold (sim engine; absent on vLLM, then kv usage stands in).
LOCAL_ONLY_BLOCKS = names.ENGINE_LOCAL_ONLY_BLOCKS

# The router's count of requests held while no engine can take them (scale from zero): what wakes a role at 0.
HELD_REQUESTS = names.ROUTER_HELD_REQUESTS
# The router's requests whose prompt decode computes for lack of prefill room: prefill's demand all the same.
DECODE_PREFILL_REQUESTS = names.ROUTER_DECODE_PREFILL_REQUESTS


@dataclass(frozen=True)
class Histogram:
    """A cumulative Prometheus histogram summed over label sets: (upper bound, count) pairs, sum and count."""

    buckets: tuple[tuple[float, float], ...]
    sum: float
    count: float

    def minus(self, older: Histogram) -> Histogram | None:
        """The observations between ``older`` and this one; None when the counter went backwards (restart)."""
        if self.count < older.count or self.sum < older.sum - 1e-9:
            return None
        old = dict(older.buckets)
        return Histogram(tuple((le, c - old.get(le, 0.0)) for le, c in self.buckets),
                         self.sum - older.sum, self.count - older.count)

    def mean(self) -> float | None:
        return self.sum / self.count if self.count > 0 else None

    def quantile_floor(self, q: float) -> float | None:
        """The lower edge of the bucket holding the q-th observation: the quantile is certainly at least this."""
        if self.count <= 0 or not self.buckets:
            return None
        rank = q * self.count
        prev_le = 0.0
        for le, c in self.buckets:
            if c >= rank:
                return prev_le
            prev_le = le
        return prev_le

    def quantile(self, q: float) -> float | None:
        """Like PromQL's histogram_quantile: linear within the bucket that holds the q-th observation."""
        if self.count <= 0 or not self.buckets:
            return None
        rank = q * self.count
        prev_le, prev_c = 0.0, 0.0
        for le, c in self.buckets:
            if c >= rank:
                if math.isinf(le):
                    return prev_le  # the top finite bound is the best that can be said
                if c == prev_c:
                    return le
                return prev_le + (le - prev_le) * (rank - prev_c) / (c - prev_c)
            prev_le, prev_c = le, c
        return prev_le


def merge_histograms(items: Iterable[Histogram]) -> Histogram | None:
    """Sum histograms with the same bucket bounds (one role's pods)."""
    items = list(items)
    if not items:
        return None
    totals: dict[float, float] = {}
    for h in items:
        for le, c in h.buckets:
            totals[le] = totals.get(le, 0.0) + c
    return Histogram(tuple(sorted(totals.items())), sum(h.sum for h in items), sum(h.count for h in items))


@dataclass(frozen=True)
class PodSample:
    """One scrape of one engine pod's /metrics."""

    pod: str
    time: float  # seconds, any monotonic clock shared by the samples of one planner
    running: float
    waiting: float
    ttft: Histogram | None = None
    itl: Histogram | None = None
    e2e: Histogram | None = None
    prompt_tokens: float | None = None
    cache_queries: float | None = None
    cache_hits: float | None = None
    external_hits: float | None = None
    kv_usage: float | None = None
    local_only_blocks: float | None = None


class MetricsError(DaybreakError, ValueError):
    """A /metrics body that is not Prometheus text or lacks vLLM's request gauges."""


def parse_metrics(text: str, *, pod: str, time: float) -> PodSample:
    """Parse an engine's Prometheus text (vLLM names), summing every label set (model_name, finished_reason...)."""
    values: dict[str, float] = {}
    buckets: dict[str, dict[float, float]] = {}
    try:
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if not math.isfinite(s.value) and not s.name.endswith("_bucket"):
                    continue
                if s.name.endswith("_bucket") and "le" in s.labels:
                    le = float(s.labels["le"])
                    per = buckets.setdefault(s.name[: -len("_bucket")], {})
                    per[le] = per.get(le, 0.0) + s.value
                else:
                    values[s.name] = values.get(s.name, 0.0) + s.value
    except (ValueError, TypeError, IndexError) as exc:
        raise MetricsError(f"pod {pod}: /metrics is not Prometheus text: {exc}") from exc
    if RUNNING not in values or WAITING not in values:
        raise MetricsError(f"pod {pod}: /metrics lacks {RUNNING} / {WAITING} (is it a vLLM-compatible engine?)")

    def counter(name: str) -> float | None:
        for candidate in (name + "_total", name):
            if candidate in values:
                return values[candidate]
        return None

    def histogram(name: str) -> Histogram | None:
        if name not in buckets or name + "_count" not in values:
            return None
        return Histogram(tuple(sorted(buckets[name].items())), values.get(name + "_sum", 0.0), values[name + "_count"])

    return PodSample(
        pod=pod, time=time, running=values[RUNNING], waiting=values[WAITING],
        ttft=histogram(TTFT), itl=histogram(ITL) or histogram(ITL_OLD), e2e=histogram(E2E),
        prompt_tokens=counter(PROMPT_TOKENS), cache_queries=counter(CACHE_QUERIES), cache_hits=counter(CACHE_HITS),
        external_hits=counter(EXTERNAL_HITS),
        kv_usage=values.get(KV_USAGE), local_only_blocks=values.get(LOCAL_ONLY_BLOCKS),
    )


@dataclass(frozen=True)
class RouterBacklog:
    """What one router's /metrics says the engines do not see in their own queues."""

    held: float
    """``daybreak_router_held_requests`` summed over roles: waiting for a ready engine or for prefill room."""
    decode_prefill: float = 0.0
    """``daybreak_router_decode_prefill_requests``: prompts decode computes because prefill had no room."""

    def __add__(self, other: RouterBacklog) -> RouterBacklog:
        return RouterBacklog(self.held + other.held, self.decode_prefill + other.decode_prefill)


def parse_router_backlog(text: str) -> RouterBacklog | None:
    """The router's held-requests (summed over label sets) and decode-prefill gauges from its /metrics text;
    None when it lacks the held gauge (a router that cannot hold requests) or is not Prometheus text."""
    held: float | None = None
    decode_prefill = 0.0
    try:
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if not math.isfinite(s.value):
                    continue
                if s.name == HELD_REQUESTS:
                    held = (held or 0.0) + s.value
                elif s.name == DECODE_PREFILL_REQUESTS:
                    decode_prefill += s.value
    except (ValueError, TypeError, IndexError):
        return None
    return None if held is None else RouterBacklog(held, decode_prefill)


@dataclass(frozen=True)
class PodWindow:
    """What one pod did between two samples."""

    pod: str
    seconds: float
    requests: float  # first tokens produced (prefill) or requests finished, whichever the engine reports
    uncached_tokens: float | None  # prompt tokens computed: neither the engine's prefix cache nor the pool had them
    mean_running: float
    mean_waiting: float
    running_change: float  # running at the end minus at the start
    waiting_growth: float  # queued requests at the end minus at the start (demand the pod could not serve)
    ttft: Histogram | None
    itl: Histogram | None
    in_flight_now: float = 0.0  # running + waiting at the newer sample: the work the pod holds right now


def window(older: PodSample, newer: PodSample) -> PodWindow | None:
    """The pod's activity between two samples; None when the engine restarted or no time passed."""
    dt = newer.time - older.time
    if dt <= 0:
        return None
    ttft = newer.ttft.minus(older.ttft) if newer.ttft and older.ttft else None
    itl = newer.itl.minus(older.itl) if newer.itl and older.itl else None
    e2e = newer.e2e.minus(older.e2e) if newer.e2e and older.e2e else None
    if (newer.ttft and older.ttft and ttft is None) or (newer.itl and older.itl and itl is None):
        return None  # counters went backwards: a restarted engine
    if ttft is not None:
        requests = ttft.count
    elif e2e is not None:
        requests = e2e.count
    else:
        requests = 0.0
    uncached = None
    if newer.prompt_tokens is not None and older.prompt_tokens is not None:
        prompt = newer.prompt_tokens - older.prompt_tokens
        hits = 0.0
        if newer.cache_hits is not None and older.cache_hits is not None:
            hits = newer.cache_hits - older.cache_hits
        if newer.external_hits is not None and older.external_hits is not None:
            hits += newer.external_hits - older.external_hits
        if prompt < 0 or hits < 0:
            return None
        uncached = max(0.0, prompt - hits)
    return PodWindow(
        pod=newer.pod, seconds=dt, requests=requests, uncached_tokens=uncached,
        mean_running=(older.running + newer.running) / 2, mean_waiting=(older.waiting + newer.waiting) / 2,
        running_change=newer.running - older.running, waiting_growth=newer.waiting - older.waiting, ttft=ttft, itl=itl,
        in_flight_now=newer.running + newer.waiting,
    )
