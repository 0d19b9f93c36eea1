"""The simulated engine: continuous batching over a cost model, with real KV lookups, reads and writes.

Life of a request (``Engine.submit``):

1. **KV lookup**, outside the batch (like vLLM's asynchronous KV-connector loads: a request
   waiting for remote KV does not stall the running batch). The engine-local prefix cache
   first, then the pool: prefill and both roles ask ``batch_exists`` for every key and read
   the leading present blocks; the decode role reads the prompt's blocks straight away. Every
   block read is checked by content; the first missing or bad block ends the usable prefix.
   The modelled load time (``CostModel.load_seconds``) is slept, less the time the real I/O took.
2. **Waiting -> running**: FIFO, while fewer than ``max_batch`` sequences run.
3. **Steps** (``plan_step``, vLLM V1's policy): every running sequence past its prefill gets one
   decode token; the rest of the step's token budget (``max_step_tokens``, chunked prefill) goes
   to prefilling sequences in arrival order, one chunk each. A step lasts
   ``CostModel.step_seconds`` of that mix. The step that finishes a prompt also samples its first
   token, as in vLLM.
4. **Write-back**: when its prefill finishes, a sequence's full-block keys enter the local cache
   and (prefill and both roles, with a pool) the blocks the pool lacks are written; the request
   ends only after its writes land, so a decode engine asked next finds them.

At least one prompt token is always computed (the last one's logits are needed), as in vLLM.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import math
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from daybreak.client import KVPoolError
from daybreak.serving.sim.costmodel import CostModel, PrefillChunk
from daybreak.serving.sim.kv import LocalCache, PoolIO, ReadResult

log = logging.getLogger(__name__)

Sleep = Callable[[float], Awaitable[Any]]


class Role(StrEnum):
    """What the engine does with the pool, like vLLM's kv_producer / kv_consumer / kv_both."""

    PREFILL = "prefill"
    DECODE = "decode"
    BOTH = "both"


@dataclass
class Usage:
    """Per-request KV accounting, returned as ``usage`` (see serving.openai.usage_dict)."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    local_hit_tokens: int = 0
    pool_hit_tokens: int = 0
    computed_tokens: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    blocks_checked: int = 0
    blocks_corrupt: int = 0

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens whose KV came from a cache (engine-local or pool) instead of being computed."""
        return self.local_hit_tokens + self.pool_hit_tokens


@dataclass(eq=False)
class SeqState:
    """One request inside the scheduler: how much of its prompt is computed, how many tokens it has made."""

    rid: int
    prompt_tokens: int
    cached_tokens: int
    max_tokens: int
    computed: int = 0
    generated: int = 0
    arrived: float = 0.0
    out: asyncio.Queue[int | None] = field(default_factory=asyncio.Queue)
    done: asyncio.Event = field(default_factory=asyncio.Event)
    aborted: bool = False
    on_prefilled: Callable[[], None] | None = None

    @property
    def to_compute(self) -> int:
        return self.prompt_tokens - self.cached_tokens

    @property
    def prefilling(self) -> bool:
        return self.computed < self.to_compute

    @property
    def context(self) -> int:
        """Tokens of KV this sequence holds now."""
        return self.cached_tokens + self.computed + self.generated

    @property
    def finished(self) -> bool:
        return not self.prefilling and self.generated >= self.max_tokens


@dataclass
class StepPlan:
    """One step: the sequences that decode a token and the prefill chunks (sequence, tokens)."""

    decode: list[SeqState]
    chunks: list[tuple[SeqState, int]]

    @property
    def empty(self) -> bool:
        return not self.decode and not self.chunks


def plan_step(running: Sequence[SeqState], *, token_budget: int) -> StepPlan:
    """vLLM V1's mix: a decode token for every sequence past prefill, then prefill chunks in the budget left.

    Decode rows are never starved by a long prompt (ITL stays bounded by one chunk's compute);
    a prompt longer than the budget is spread over several steps (chunked prefill).
    """
    decode = [s for s in running if not s.prefilling and s.generated < s.max_tokens]
    budget = token_budget - len(decode)
    chunks: list[tuple[SeqState, int]] = []
    for seq in running:
        if budget <= 0:
            break
        if seq.prefilling:
            n = min(seq.to_compute - seq.computed, budget)
            chunks.append((seq, n))
            budget -= n
    return StepPlan(decode, chunks)


def apply_step(plan: StepPlan) -> list[SeqState]:
    """Advance the sequences of ``plan``; returns those that produced a token in this step (in order)."""
    emitted: list[SeqState] = []
    for seq in plan.decode:
        seq.generated += 1
        emitted.append(seq)
    for seq, n in plan.chunks:
        seq.computed += n
        if not seq.prefilling:
            if seq.on_prefilled is not None:
                seq.on_prefilled()
            if seq.max_tokens > 0:
                seq.generated += 1  # the step that finishes a prompt samples its first token
                emitted.append(seq)
    return emitted


def step_cost(plan: StepPlan, model: CostModel) -> float:
    """Modelled duration of ``plan``."""
    return model.step_seconds(
        decode_batch=len(plan.decode), decode_context_tokens=sum(s.context for s in plan.decode),
        chunks=[PrefillChunk(tokens=n, context=s.cached_tokens + s.computed) for s, n in plan.chunks])


class EngineMetrics:
    """What the engine reports as it works; ``serving.sim.metrics`` maps it to Prometheus (a no-op default)."""

    def queue(self, *, running: int, waiting: int, kv_usage: float) -> None:
        """Queue lengths and KV usage after a change."""

    def request_done(self, usage: Usage, *, local_queried: int, pool_queried_blocks: int,
                     pool_hit_blocks: int, block_tokens: int) -> None:
        """A finished request's KV accounting."""

    def step(self, *, seconds: float, decode: int, prefill_tokens: int) -> None:
        """One scheduler step."""

    def pool_error(self) -> None:
        """A pool call failed (the request went on as if the pool were empty)."""

    def local_only(self, blocks: int) -> None:
        """Engine-local cached blocks the pool is not known to hold (the planner's scale-in cost)."""


@dataclass(frozen=True)
class EngineConfig:
    """How an engine is set up (the CLI builds it from flags and environment)."""

    role: Role = Role.BOTH
    namespace: str = "default"
    block_tokens: int = 16
    block_bytes: int = 4096
    model_block_bytes: int = 2 * 32 * 8 * 128 * 2 * 16
    """Bytes per block the cost model charges loads for: the layout's, even when ``block_bytes`` is scaled down."""
    max_batch: int = 64
    max_step_tokens: int = 2048
    local_cache_blocks: int = 8192
    cost: CostModel = field(default_factory=CostModel)

    def __post_init__(self) -> None:
        if self.max_batch < 1:
            raise ValueError(f"--max-num-seqs must be at least 1, got {self.max_batch}")
        if self.max_step_tokens < self.max_batch:
            raise ValueError(f"--max-step-tokens ({self.max_step_tokens}) must be at least --max-num-seqs "
                             f"({self.max_batch}): every decode row needs a token of the budget")
        if self.block_tokens < 1 or self.block_bytes < 1:
            raise ValueError("block tokens and block bytes must be positive")


@dataclass
class Lookup:
    """What the KV lookup of one request found: leading blocks cached locally, then in the pool."""

    local: int = 0
    pool_hits: int = 0
    pool_queried: int = 0
    write: list[int] = field(default_factory=list)
    """Indices of the blocks to write to the pool once computed (the ones it lacks or held bad)."""


class Handle:
    """A submitted request: iterate ``tokens()`` for output token indices, then read ``usage``."""

    def __init__(self, engine: Engine, seq: SeqState) -> None:
        self._engine = engine
        self.seq = seq
        self._task: asyncio.Task[None] | None = None
        self.usage = Usage(prompt_tokens=seq.prompt_tokens)

    async def tokens(self) -> AsyncIterator[int]:
        """Output token indices 0..max_tokens-1 as the engine produces them; raises what the request raised."""
        while True:
            item = await self.seq.out.get()
            if item is None:
                break
            yield item
        assert self._task is not None
        await self._task  # write-back and accounting done (or its error raised)

    def abort(self) -> None:
        """Drop the request (its client went away): it leaves the queues and its slot is freed."""
        self._engine._abort(self)


class Engine:
    """Continuous batching over ``config.cost`` with KV through ``pool`` (None: engine-local cache only)."""

    def __init__(self, config: EngineConfig, *, pool: PoolIO | None, metrics: EngineMetrics | None = None,
                 sleep: Sleep = asyncio.sleep, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.pool = pool
        self.cache = LocalCache(config.local_cache_blocks)
        self.metrics = metrics or EngineMetrics()
        self._sleep = sleep
        self._clock = clock
        self._ids = itertools.count(1)
        self.waiting: deque[SeqState] = deque()
        self.running: list[SeqState] = []
        self.looking_up = 0
        self._wake = asyncio.Event()
        self._loop_task: asyncio.Task[None] | None = None
        self._handles: dict[int, Handle] = {}

    # -- lifecycle ---------------------------------------------------------------------------------

    def start(self) -> None:
        """Start the scheduler loop (needs a running event loop)."""
        if self._loop_task is None:
            self._loop_task = asyncio.get_running_loop().create_task(self._schedule(), name="sim-scheduler")

    async def stop(self) -> None:
        """Stop the scheduler loop (in-flight requests are dropped: drain first)."""
        if self._loop_task is not None:
            self._loop_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._loop_task
            self._loop_task = None

    @property
    def in_flight(self) -> int:
        """Requests submitted and not finished."""
        return len(self._handles)

    # -- requests ----------------------------------------------------------------------------------

    def submit(self, tokens: Sequence[int], keys: Sequence[str], *, max_tokens: int) -> Handle:
        """Start a request for ``tokens`` (full-block ``keys``) that produces ``max_tokens`` tokens."""
        if self.config.role == Role.PREFILL:
            max_tokens = min(max_tokens, 1)  # a producer's answer is its first token; decode makes the rest
        seq = SeqState(rid=next(self._ids), prompt_tokens=len(tokens), cached_tokens=0, max_tokens=max_tokens,
                        arrived=self._clock())
        handle = Handle(self, seq)
        self._handles[seq.rid] = handle
        handle._task = asyncio.get_running_loop().create_task(self._run(handle, list(keys)),
                                                              name=f"sim-request-{seq.rid}")
        self.looking_up += 1
        self._report_queue()
        return handle

    async def _run(self, handle: Handle, keys: list[str]) -> None:
        seq = handle.seq
        usage = handle.usage
        bt = self.config.block_tokens
        write_task: asyncio.Task[None] | None = None
        try:
            try:
                lookup = await self._lookup(keys, usage)
            finally:
                self.looking_up -= 1
            cached = min((lookup.local + lookup.pool_hits) * bt, max(seq.prompt_tokens - 1, 0))
            usage.local_hit_tokens = min(lookup.local * bt, cached)
            usage.pool_hit_tokens = cached - usage.local_hit_tokens
            usage.computed_tokens = seq.prompt_tokens - cached
            seq.cached_tokens = cached

            def prefilled() -> None:
                nonlocal write_task
                self.cache.insert(keys)
                if self.pool is not None:
                    self.cache.mark_pooled(keys[lookup.local:lookup.local + lookup.pool_hits])
                    if self.config.role == Role.DECODE:
                        self.cache.mark_unpooled(keys[lookup.local + lookup.pool_hits:])  # computed, not written
                    else:
                        self.cache.mark_unpooled([keys[i] for i in lookup.write])  # until the write lands
                    self.metrics.local_only(self.cache.local_only)
                if lookup.write and self.pool is not None:
                    write_task = asyncio.get_running_loop().create_task(
                        self._write([keys[i] for i in lookup.write], usage), name=f"sim-write-{seq.rid}")

            seq.on_prefilled = prefilled
            if seq.aborted:
                return
            if seq.max_tokens == 0 and seq.to_compute == 0:
                seq.done.set()
            else:
                self.waiting.append(seq)
                self._report_queue()
                self._wake.set()
            await seq.done.wait()
            if write_task is not None:
                await write_task
            usage.completion_tokens = seq.generated
            self.metrics.request_done(usage, local_queried=len(keys), pool_queried_blocks=lookup.pool_queried,
                                      pool_hit_blocks=lookup.pool_hits, block_tokens=bt)
        finally:
            if write_task is not None and not write_task.done():
                write_task.cancel()
            self._remove(seq)
            seq.out.put_nowait(None)

    async def _lookup(self, keys: list[str], usage: Usage) -> Lookup:
        """The usable cached prefix of ``keys`` and which blocks to write after the prefill."""
        out = Lookup(local=self.cache.prefix(keys))
        pool = self.pool
        if pool is None or (out.local == len(keys) and self.config.role == Role.DECODE):
            return out
        started = self._clock()
        try:
            if self.config.role == Role.DECODE:
                # A consumer reads what the producer wrote; what is missing it computes, never writes.
                result = await pool.read_prefix(keys[out.local:])
                out.pool_queried = len(keys) - out.local
            else:
                present = await pool.exists(keys)
                lead = 0
                for ok in present[out.local:]:
                    if not ok:
                        break
                    lead += 1
                result = await pool.read_prefix(keys[out.local:out.local + lead]) if lead else ReadResult()
                out.pool_queried = len(keys) - out.local
                bad = {out.local + i for i in result.corrupt}
                # Write what the pool lacks (including locally cached blocks it evicted) and what was bad.
                out.write = [i for i, ok in enumerate(present) if not ok or i in bad]
        except (KVPoolError, OSError) as exc:
            log.warning("event=pool_error op=lookup error=%s action=compute_without_pool", exc)
            self.metrics.pool_error()
            out.write = [] if self.config.role == Role.DECODE else list(range(len(keys)))
            return out
        out.pool_hits = result.good
        usage.blocks_checked += result.checked
        usage.blocks_corrupt += len(result.corrupt)
        usage.bytes_read += result.bytes_read
        # The modelled transfer into accelerator memory, less what the real read already took.
        modelled = self.config.cost.load_seconds(blocks=result.good, block_bytes=self.config.model_block_bytes)
        remaining = modelled - (self._clock() - started)
        if remaining > 0:
            await self._sleep(remaining)
        return out

    async def _write(self, keys: list[str], usage: Usage) -> None:
        assert self.pool is not None
        try:
            stored, sent = await self.pool.write(keys)
        except (KVPoolError, OSError) as exc:
            log.warning("event=pool_error op=write blocks=%d error=%s", len(keys), exc)
            self.metrics.pool_error()
            return
        usage.bytes_written += sent
        if stored == len(keys):
            self.cache.mark_pooled(keys)
            self.metrics.local_only(self.cache.local_only)

    async def hand_off(self, *, seconds: float, chunk_blocks: int = 64) -> tuple[int, int]:
        """Before exit: write the engine-local blocks the pool lacks, hottest first, within ``seconds``.

        Returns (blocks written, bytes sent). What does not fit in the time is lost, coldest first.
        """
        pool = self.pool
        keys = self.cache.unpooled()
        if pool is None or not keys or seconds <= 0:
            return 0, 0
        deadline = self._clock() + seconds
        written = sent = 0

        async def run() -> None:
            nonlocal written, sent
            for start in range(0, len(keys), chunk_blocks):
                chunk = keys[start:start + chunk_blocks]
                present = await pool.exists(chunk)
                missing = [k for k, ok in zip(chunk, present, strict=True) if not ok]
                self.cache.mark_pooled([k for k, ok in zip(chunk, present, strict=True) if ok])
                if missing:
                    stored, nbytes = await pool.write(missing)
                    written += stored
                    sent += nbytes
                    if stored == len(missing):
                        self.cache.mark_pooled(missing)
                if self._clock() >= deadline:
                    return

        try:
            await asyncio.wait_for(run(), timeout=max(deadline - self._clock(), 0.001))
        except TimeoutError:
            log.warning("event=handoff_incomplete written=%d of=%d reason=timeout", written, len(keys))
        except (KVPoolError, OSError) as exc:
            log.warning("event=handoff_failed written=%d of=%d error=%s", written, len(keys), exc)
        self.metrics.local_only(self.cache.local_only)
        return written, sent

    def _abort(self, handle: Handle) -> None:
        seq = handle.seq
        if seq.rid not in self._handles:
            return
        seq.aborted = True
        self._remove(seq)
        seq.done.set()

    def _remove(self, seq: SeqState) -> None:
        if seq in self.running:
            self.running.remove(seq)
        with contextlib.suppress(ValueError):
            self.waiting.remove(seq)
        self._handles.pop(seq.rid, None)
        self._report_queue()

    # -- the scheduler -----------------------------------------------------------------------------

    def kv_usage(self) -> float:
        """Fraction of the engine's KV capacity (local cache blocks) the running sequences hold."""
        if not self.config.local_cache_blocks:
            return 0.0
        held = sum(math.ceil(s.context / self.config.block_tokens) for s in self.running)
        return min(1.0, held / self.config.local_cache_blocks)

    def _report_queue(self) -> None:
        self.metrics.queue(running=len(self.running), waiting=len(self.waiting) + self.looking_up,
                           kv_usage=self.kv_usage())

    async def _schedule(self) -> None:
        cfg = self.config
        while True:
            while self.waiting and len(self.running) < cfg.max_batch:
                self.running.append(self.waiting.popleft())
            plan = plan_step(self.running, token_budget=cfg.max_step_tokens)
            if plan.empty:
                self._report_queue()
                self._wake.clear()
                await self._wake.wait()
                continue
            self._report_queue()
            seconds = step_cost(plan, cfg.cost)
            await self._sleep(seconds)
            self.metrics.step(seconds=seconds, decode=len(plan.decode), prefill_tokens=sum(n for _, n in plan.chunks))
            for seq in apply_step(plan):
                if seq.rid in self._handles:
                    seq.out.put_nowait(seq.generated - 1)
            for seq in [s for s in self.running if s.finished]:
                self.running.remove(seq)
                seq.done.set()
