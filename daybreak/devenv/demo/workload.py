"""The demo's workload: agent-style sessions stepped up and down, over a time-scaled slice of the trace.

Two streams through the router, on one asyncio loop, into one list of
``RequestRecord`` (``daybreak.serving.load``'s runner and summary types):

* sessions (``daybreak.serving.load.sessions``): multi-turn conversations
  sharing a system prompt, Poisson arrivals whose rate follows the phases
  (base, 4x, base): this is what the planner scales on;
* the trace: a steady background from ``synthetic_trace.jsonl``: one request in
  ``TRACE_SAMPLE`` kept whole by prefix tree (``sample_by_root``, so reuse is
  kept), sent at their timestamps times ``trace_time_scale``, each cut to its
  first trace block (512 tokens) and at most 32 output tokens so 2 cores cope.
  Cutting keeps reuse: requests that share a prefix share its first block. The
  trace's reuse builds up over its 17 minutes; the first minute of it repeats
  about one block in ten, which the summary reports as ``trace_slice_reuse``.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from daybreak.serving.load.runner import send
from daybreak.serving.load.sessions import Session, text
from daybreak.serving.load.summary import RequestRecord
from daybreak.serving.load.trace import TraceRequest, read_trace, sample_by_root

log = logging.getLogger(__name__)

MODEL = "sim-model"
TRACE_BLOCKS = 1
TRACE_SAMPLE = 10
TRACE_OUTPUT_TOKENS = 32
SYSTEM_TOKENS = 128
USER_TOKENS = 256
OUTPUT_TOKENS = 64
TURNS = 3


@dataclass(frozen=True)
class Phase:
    """A stretch of the run at ``multiple`` times the base session rate."""

    name: str
    seconds: float
    multiple: float


def phases(total_s: float) -> list[Phase]:
    """Base, a 4x step, base again: 20% / 40% / 40% of the run."""
    return [Phase("base", total_s * 0.2, 1.0), Phase("step up (4x)", total_s * 0.4, 4.0),
            Phase("step down (1x)", total_s * 0.4, 1.0)]


@dataclass
class Workload:
    """What the demo sends and what came back; ``records`` grows while it runs (read by the live view)."""

    url: str
    seconds: float
    trace: Path | None
    base_rate: float = 0.3
    trace_time_scale: float = 2.5
    seed: int = 0
    records: list[RequestRecord] = field(default_factory=list)
    kinds: list[str] = field(default_factory=list)  # "session" or "trace", per record
    in_flight: int = 0
    started: float = 0.0
    phase: str = "starting"
    sent_blocks: list[tuple[int, ...]] = field(default_factory=list)  # trace prompts, for the reuse figure

    def elapsed(self) -> float:
        return time.monotonic() - self.started if self.started else 0.0

    async def _one(self, http: aiohttp.ClientSession, path: str, body: dict[str, object], kind: str
                   ) -> RequestRecord:
        self.in_flight += 1
        try:
            record, reply = await send(http, self.url + path, body, timeout_s=120.0)
        finally:
            self.in_flight -= 1
        record.reply = reply
        self.records.append(record)
        self.kinds.append(kind)
        return record

    async def run(self, *, on_phase: Callable[[str], None] | None = None) -> None:
        """Send both streams for ``seconds``, then wait for what is in flight."""
        self.started = time.monotonic()
        connector = aiohttp.TCPConnector(limit=128)
        async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as http:
            streams = [self._sessions(http, on_phase=on_phase)]
            if self.trace is not None:
                streams.append(self._trace(http))
            await asyncio.gather(*streams)

    async def _sessions(self, http: aiohttp.ClientSession, *, on_phase: Callable[[str], None] | None) -> None:
        rng = random.Random(self.seed)
        system = text(SYSTEM_TOKENS, seed=self.seed)
        idle: list[Session] = []
        opened = 0
        tasks: set[asyncio.Task[None]] = set()

        async def turn(s: Session) -> None:
            body = s.next_body(model=MODEL, max_tokens=OUTPUT_TOKENS)
            record = await self._one(http, "/v1/chat/completions", body, "session")
            if record.ok and s.turns + 1 < TURNS:
                s.answered(record.reply)
                idle.append(s)

        at = 0.0
        for phase in phases(self.seconds):
            self.phase = phase.name
            if on_phase:
                on_phase(phase.name)
            end = at + phase.seconds
            rate = self.base_rate * phase.multiple
            next_at = at + rng.expovariate(rate)
            while next_at < end:
                delay = next_at - self.elapsed()
                if delay > 0:
                    await asyncio.sleep(delay)
                # An idle conversation takes its next turn; else a new one opens (sessions never wait).
                if idle:
                    s = idle.pop(rng.randrange(len(idle)))
                else:
                    s = Session(index=opened, system=system, seed=self.seed + opened, user_chars=USER_TOKENS)
                    opened += 1
                task = asyncio.create_task(turn(s))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
                next_at += rng.expovariate(rate)
            at = end
            delay = at - self.elapsed()
            if delay > 0:
                await asyncio.sleep(delay)
        self.phase = "draining"
        if tasks:
            await asyncio.gather(*list(tasks))

    async def _trace(self, http: aiohttp.ClientSession) -> None:
        assert self.trace is not None
        tasks: list[asyncio.Task[RequestRecord]] = []
        first: float | None = None
        for req in sample_by_root(read_trace(self.trace), every=TRACE_SAMPLE):
            first = req.timestamp_ms if first is None else first
            at = (req.timestamp_ms - first) / 1000 * self.trace_time_scale
            if at >= self.seconds:
                break
            delay = at - self.elapsed()
            if delay > 0:
                await asyncio.sleep(delay)
            cut = cut_request(req)
            self.sent_blocks.append(cut.hash_ids)
            tasks.append(asyncio.create_task(self._one(http, "/v1/completions", cut.body(model=MODEL), "trace")))
        if tasks:
            await asyncio.gather(*tasks)


def cut_request(req: TraceRequest) -> TraceRequest:
    """``req`` cut to its first ``TRACE_BLOCKS`` trace blocks and ``TRACE_OUTPUT_TOKENS`` output tokens."""
    blocks = req.hash_ids[:TRACE_BLOCKS]
    tokens = min(req.input_length, 512 * len(blocks))
    return TraceRequest(req.timestamp_ms, tokens, min(req.output_length, TRACE_OUTPUT_TOKENS), blocks)


def trace_reuse(prompts: list[tuple[int, ...]]) -> float | None:
    """Fraction of the trace slice's blocks already sent before (what an unbounded cache could hit)."""
    seen: set[int] = set()
    hits = total = 0
    for blocks in prompts:
        for b in blocks:
            hits += b in seen
            total += 1
            seen.add(b)
    return hits / total if total else None
