"""Metric names one process writes and another reads: the planner, ``daybreak status``, the demo and the bench.

A metric name crossing a process boundary is a contract like a label: the sim
engine writes vLLM's names and the planner reads them (from vLLM and the sim
alike), the agent writes the store's counters and ``daybreak status`` reads
them, the router writes its held-requests gauge and the planner wakes a role
at zero from it. Each is declared here once and passed to the metric objects
on the writer's side and to the parsers on the reader's (Prometheus client
libraries pass the objects around; across processes the name is all there
is). Counters are declared without ``_total``: ``prometheus_client`` adds it
to the sample, so readers of a counter compare against ``total(NAME)``.
Metrics only one process writes and reads (most of them) stay with their writer.
"""

from __future__ import annotations

# --- vLLM's engine metrics (vllm/v1/metrics/loggers.py): written by vLLM and the sim engine, read by the planner
VLLM_RUNNING = "vllm:num_requests_running"
VLLM_WAITING = "vllm:num_requests_waiting"
VLLM_KV_USAGE = "vllm:kv_cache_usage_perc"
VLLM_TTFT = "vllm:time_to_first_token_seconds"
VLLM_ITL = "vllm:inter_token_latency_seconds"
VLLM_ITL_OLD = "vllm:time_per_output_token_seconds"  # vLLM before 0.10 names ITL this way
VLLM_E2E = "vllm:e2e_request_latency_seconds"
VLLM_PROMPT_TOKENS = "vllm:prompt_tokens"  # counter
VLLM_PREFIX_CACHE_QUERIES = "vllm:prefix_cache_queries"  # counter
VLLM_PREFIX_CACHE_HITS = "vllm:prefix_cache_hits"  # counter
VLLM_EXTERNAL_PREFIX_CACHE_HITS = "vllm:external_prefix_cache_hits"  # counter: tokens found through the pool

# --- Daybreak's engine-side metrics read elsewhere ------------------------------------------------------------
ENGINE_LOCAL_ONLY_BLOCKS = "daybreak_engine_local_only_blocks"
"""Gauge (sim engine): engine-local cache the pool does not hold; the planner's scale-in cost."""
ENGINE_KV_BYTES = "daybreak_engine_kv_bytes"
"""Counter (sim engine), label ``direction`` read|written: the demo's live view."""
ROUTER_HELD_REQUESTS = "daybreak_router_held_requests"
"""Gauge (router): requests held while no engine can take them; what wakes a role scaled to zero."""
ROUTER_DECODE_PREFILL_REQUESTS = "daybreak_router_decode_prefill_requests"
"""Gauge (router): requests whose prompt decode computes because no prefill pod had room (``--decode-prefill``);
the planner counts them in prefill's backlog."""

# --- The agent's store and transfer counters, read by ``daybreak status`` ---------------------------------------
STORE_HITS = "daybreak_store_hits"  # label tier
STORE_MISSES = "daybreak_store_misses"
STORE_BYTES_OUT = "daybreak_store_bytes_out"  # label tier
STORE_BYTES = "daybreak_store_bytes"  # labels transport, op
TRANSFER_FALLBACK_BYTES = "daybreak_transfer_fallback_bytes"  # labels preferred, used
TRANSFER_FALLBACK_REASONS = "daybreak_transfer_fallback_reasons"
"""Counter, labels ``preferred``, ``used``, ``reason``: requests that completed on a later path than their
first, and why (``path_failed``, ``tripped``, ``unsupported``, ``staging_failed``; from the client:
``engine_failed``, ``no_segments``). ``used`` ``stream`` is the store's own tcp stream."""
TRANSFER_STAGED_BYTES = "daybreak_transfer_staged_bytes"
"""Counter, label ``transport``: device bytes that went through the engine's pinned host staging (tcp, rdma
without GPUDirect) instead of moving straight to or from device memory."""

# --- The operator's counters the operator bench reads ---------------------------------------------------------
OPERATOR_RECONCILES = "daybreak_operator_reconciles"
OPERATOR_APISERVER_ERRORS = "daybreak_operator_apiserver_errors"

SHARED: frozenset[str] = frozenset({
    VLLM_RUNNING, VLLM_WAITING, VLLM_KV_USAGE, VLLM_TTFT, VLLM_ITL, VLLM_ITL_OLD, VLLM_E2E, VLLM_PROMPT_TOKENS,
    VLLM_PREFIX_CACHE_QUERIES, VLLM_PREFIX_CACHE_HITS, VLLM_EXTERNAL_PREFIX_CACHE_HITS, ENGINE_LOCAL_ONLY_BLOCKS,
    ENGINE_KV_BYTES, ROUTER_HELD_REQUESTS, ROUTER_DECODE_PREFILL_REQUESTS, STORE_HITS, STORE_MISSES, STORE_BYTES_OUT, STORE_BYTES,
    TRANSFER_FALLBACK_BYTES, TRANSFER_FALLBACK_REASONS, TRANSFER_STAGED_BYTES, OPERATOR_RECONCILES, OPERATOR_APISERVER_ERRORS,
})
"""Every name above: ``tests/test_vocabulary.py`` fails when one is spelled out again elsewhere."""


def total(name: str) -> str:
    """The sample name of counter ``name`` as ``prometheus_client`` exposes it (``<name>_total``)."""
    return f"{name}_total"
