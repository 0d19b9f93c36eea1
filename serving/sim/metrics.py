"""The simulated engine's Prometheus metrics, under vLLM's names, types and ``model_name`` label.

Dashboards, the router and the planner read a sim engine and a vLLM engine the
same way: ``vllm:num_requests_running`` / ``_waiting`` (gauges),
``vllm:time_to_first_token_seconds``, ``vllm:inter_token_latency_seconds``,
``vllm:e2e_request_latency_seconds`` (histograms), ``vllm:kv_cache_usage_perc``
(gauge, 0..1), ``vllm:prefix_cache_queries`` / ``_hits`` (counters of prompt
tokens: the engine-local cache, vLLM's GPU prefix cache) and
``vllm:external_prefix_cache_queries`` / ``_hits`` (tokens asked of and found
in the pool, vLLM's KV-connector cache). Daybreak's own:
``daybreak_engine_pool_hits_total`` / ``_misses_total`` (blocks),
``daybreak_engine_kv_bytes_total{direction}``, ``daybreak_engine_blocks_checked_total``,
``daybreak_engine_blocks_corrupt_total``, ``daybreak_engine_prompt_tokens_by_source_total{source}``,
``daybreak_engine_local_only_blocks`` (gauge: engine-local blocks the pool is not known to hold).

One ``CollectorRegistry`` per engine, so tests can run several in one process.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from daybreak.api import metrics as names
from daybreak.serving.sim.engine import EngineMetrics, Usage

# vLLM's bucket edges, with finer steps below 10 ms because --time-scale shrinks every duration.
_TTFT = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
         7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL = (0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
        0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_E2E = (0.001, 0.005, 0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
        50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
_STEP = (0.0001, 0.0005, 0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)


class PromMetrics(EngineMetrics):
    """``EngineMetrics`` recorded into a fresh registry; ``render()`` is the /metrics body."""

    def __init__(self, *, model_name: str) -> None:
        self.registry = CollectorRegistry()
        r, label = self.registry, ["model_name"]
        self.running = Gauge(names.VLLM_RUNNING, "Number of requests in model execution batches.",
                             label, registry=r).labels(model_name)
        self.waiting = Gauge(names.VLLM_WAITING, "Number of requests waiting to be processed.",
                             label, registry=r).labels(model_name)
        self.kv_usage = Gauge(names.VLLM_KV_USAGE, "KV-cache usage. 1 means 100 percent usage.",
                              label, registry=r).labels(model_name)
        self.ttft = Histogram(names.VLLM_TTFT, "Histogram of time to first token in seconds.",
                              label, buckets=_TTFT, registry=r).labels(model_name)
        self.itl = Histogram(names.VLLM_ITL, "Histogram of inter-token latency in seconds.",
                             label, buckets=_ITL, registry=r).labels(model_name)
        self.e2e = Histogram(names.VLLM_E2E,
                             "Histogram of e2e request latency in seconds.", label, buckets=_E2E,
                             registry=r).labels(model_name)
        self.prefix_queries = Counter(names.VLLM_PREFIX_CACHE_QUERIES,
                                      "Prefix cache queries, in terms of number of queried tokens.",
                                      label, registry=r).labels(model_name)
        self.prefix_hits = Counter(names.VLLM_PREFIX_CACHE_HITS,
                                   "Prefix cache hits, in terms of number of cached tokens.",
                                   label, registry=r).labels(model_name)
        self.external_queries = Counter("vllm:external_prefix_cache_queries",
                                        "External prefix cache queries from KV connector cross-instance "
                                        "cache sharing, in terms of number of queried tokens.",
                                        label, registry=r).labels(model_name)
        self.external_hits = Counter(names.VLLM_EXTERNAL_PREFIX_CACHE_HITS,
                                     "External prefix cache hits from KV connector cross-instance cache "
                                     "sharing, in terms of number of cached tokens.",
                                     label, registry=r).labels(model_name)
        self.prompt_tokens = Counter(names.VLLM_PROMPT_TOKENS, "Number of prefill tokens processed.",
                                     label, registry=r).labels(model_name)
        self.generation_tokens = Counter("vllm:generation_tokens", "Number of generation tokens processed.",
                                         label, registry=r).labels(model_name)
        self.success = Counter("vllm:request_success", "Count of successfully processed requests.",
                               [*label, "finished_reason"], registry=r).labels(model_name, "length")
        self.pool_hits = Counter("daybreak_engine_pool_hits", "Blocks found in the pool and used.",
                                 label, registry=r).labels(model_name)
        self.pool_misses = Counter("daybreak_engine_pool_misses",
                                   "Blocks asked of the pool and not usable (missing, bad, or after a gap).",
                                   label, registry=r).labels(model_name)
        kv_bytes = Counter(names.ENGINE_KV_BYTES, "KV bytes moved between this engine and the pool.",
                           [*label, "direction"], registry=r)
        self.bytes_read = kv_bytes.labels(model_name, "read")
        self.bytes_written = kv_bytes.labels(model_name, "written")
        self.checked = Counter("daybreak_engine_blocks_checked", "Blocks read from the pool and checked by content.",
                               label, registry=r).labels(model_name)
        self.corrupt = Counter("daybreak_engine_blocks_corrupt",
                               "Blocks read from the pool whose bytes were wrong (recomputed).",
                               label, registry=r).labels(model_name)
        by_source = Counter("daybreak_engine_prompt_tokens_by_source",
                            "Prompt tokens by where their KV came from.", [*label, "source"], registry=r)
        self.tokens_local = by_source.labels(model_name, "local")
        self.tokens_pool = by_source.labels(model_name, "pool")
        self.tokens_computed = by_source.labels(model_name, "computed")
        self.pool_errors = Counter("daybreak_engine_pool_errors", "Pool calls that failed (served without the pool).",
                                   label, registry=r).labels(model_name)
        self.local_only_blocks = Gauge(names.ENGINE_LOCAL_ONLY_BLOCKS,
                                       "Engine-local cached blocks the pool is not known to hold (lost on scale-in "
                                       "unless handed off).", label, registry=r).labels(model_name)
        self.steps = Histogram("daybreak_engine_step_seconds", "Modelled duration of scheduler steps.",
                               label, buckets=_STEP, registry=r).labels(model_name)

    def render(self) -> bytes:
        """The Prometheus text exposition of this engine's registry."""
        return generate_latest(self.registry)

    # -- EngineMetrics ------------------------------------------------------------------------------

    def queue(self, *, running: int, waiting: int, kv_usage: float) -> None:
        self.running.set(running)
        self.waiting.set(waiting)
        self.kv_usage.set(kv_usage)

    def request_done(self, usage: Usage, *, local_queried: int, pool_queried_blocks: int,
                     pool_hit_blocks: int, block_tokens: int) -> None:
        self.prefix_queries.inc(usage.prompt_tokens)
        self.prefix_hits.inc(usage.local_hit_tokens)
        self.external_queries.inc(max(usage.prompt_tokens - usage.local_hit_tokens, 0) if pool_queried_blocks else 0)
        self.external_hits.inc(usage.pool_hit_tokens)
        self.prompt_tokens.inc(usage.prompt_tokens)
        self.generation_tokens.inc(usage.completion_tokens)
        self.pool_hits.inc(pool_hit_blocks)
        self.pool_misses.inc(max(pool_queried_blocks - pool_hit_blocks, 0))
        self.bytes_read.inc(usage.bytes_read)
        self.bytes_written.inc(usage.bytes_written)
        self.checked.inc(usage.blocks_checked)
        self.corrupt.inc(usage.blocks_corrupt)
        self.tokens_local.inc(usage.local_hit_tokens)
        self.tokens_pool.inc(usage.pool_hit_tokens)
        self.tokens_computed.inc(usage.computed_tokens)

    def step(self, *, seconds: float, decode: int, prefill_tokens: int) -> None:
        self.steps.observe(seconds)

    def pool_error(self) -> None:
        self.pool_errors.inc()

    def local_only(self, blocks: int) -> None:
        self.local_only_blocks.set(blocks)

    def served(self, *, ttft: float | None, itls: list[float], e2e: float) -> None:
        """Latencies measured on the served response (the server calls this when a request ends)."""
        if ttft is not None:
            self.ttft.observe(ttft)
        for gap in itls:
            self.itl.observe(gap)
        self.e2e.observe(e2e)
        self.success.inc()
