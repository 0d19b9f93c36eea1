"""``daybreak load``: replay a trace or run agent-style sessions against one OpenAI-compatible URL.

Trace mode (``--trace FILE``, Mooncake JSONL or Azure LLM CSV, see
``daybreak.serving.load.trace``): requests are sent at their timestamps times
``--time-scale`` (0.1 replays ten times faster), every ``--sample``-th only
(the rate divided by N, the shape kept), with the ``hash_ids`` prompt
extension and ``max_tokens = output_length`` (times ``--token-scale`` and
``--output-scale``).
Sessions mode (``--sessions N``): see ``daybreak.serving.load.sessions``; its
rate is constant, stepped (``--rate-steps``) or shaped (``--rate-shape``: a
sinusoid or a ramp). Both stop sending at ``--max-requests``
or ``--duration`` seconds, whichever comes first, then wait for what is in
flight (each request bounded by ``--request-timeout``). Progress goes to
stderr (one refreshed line on a terminal, a line every 5 s otherwise); the
summary (``daybreak.serving.load.summary``) to ``--json`` and stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import aiohttp

from daybreak.logs import setup_logging
from daybreak.serving.load.runner import send
from daybreak.serving.load.sessions import RateStep, Session, parse_steps, rate_at, text
from daybreak.serving.load.summary import RequestRecord, progress_line, summarize
from daybreak.serving.load.trace import TraceError, parse_shape, read_trace, scale_tokens

log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", required=True, help="base URL of the router or engine, e.g. http://127.0.0.1:8000")
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--trace", type=Path,
                      help="trace to replay: Mooncake JSONL, or Azure LLM CSV (TIMESTAMP,ContextTokens,"
                           "GeneratedTokens; no prefix ids: every request's blocks are its own)")
    mode.add_argument("--sessions", type=int, help="sessions mode: how many conversations to open in all")
    parser.add_argument("--time-scale", type=float, default=1.0,
                        help="trace: multiply arrival times by this (0.1 = ten times faster)")
    parser.add_argument("--sample", type=int, default=1, metavar="N",
                        help="trace: keep every N-th request (the rate divided by N, the shape kept)")
    parser.add_argument("--token-scale", type=float, default=1.0,
                        help="trace: multiply each request's prompt tokens by this (at least 1)")
    parser.add_argument("--output-scale", type=float, default=None,
                        help="trace: multiply each request's output tokens by this (default: --token-scale)")
    parser.add_argument("--max-requests", type=int, default=None, help="send at most this many requests")
    parser.add_argument("--duration", type=float, default=600.0,
                        help="stop sending after this many seconds (default 600)")
    parser.add_argument("--turns", type=int, default=4, help="sessions: turns per session")
    parser.add_argument("--rate", type=float, default=1.0, help="sessions: requests per second (Poisson)")
    parser.add_argument("--rate-steps", default=None,
                        help="sessions: rate over time, e.g. 1x:30s,4x:30s,1x:30s (multiples of --rate) or 2:30s")
    parser.add_argument("--rate-shape", default=None,
                        help="sessions: a shaped rate instead of steps: sine:LOW:HIGH:PERIODs (starting at LOW) "
                             "or ramp:FROM:TO:SECONDSs (then held), rates absolute or multiples of --rate "
                             "(sine:1x:4x:60s)")
    parser.add_argument("--system-tokens", type=int, default=2048, help="sessions: shared system prompt length")
    parser.add_argument("--user-tokens", type=int, default=256, help="sessions: new user text per turn")
    parser.add_argument("--output-tokens", type=int, default=64, help="sessions: max_tokens per turn")
    parser.add_argument("--seed", type=int, default=0, help="sessions: text and arrival seed")
    parser.add_argument("--model", default=os.environ.get("DAYBREAK_MODEL") or "sim",
                        help="model field of each request ($DAYBREAK_MODEL, else 'sim')")
    parser.add_argument("--max-concurrency", type=int, default=256, help="requests in flight at most")
    parser.add_argument("--request-timeout", type=float, default=300.0, help="seconds per request")
    parser.add_argument("--json", type=Path, default=None, help="write the summary here")
    parser.add_argument("--quiet", action="store_true", help="no progress output")


class _Run:
    """Shared state of one run: the records, the in-flight cap and the progress reporter."""

    def __init__(self, *, url: str, args: argparse.Namespace) -> None:
        self.url = url.rstrip("/")
        self.args = args
        self.records: list[RequestRecord] = []
        self.in_flight = 0
        self.slots = asyncio.Semaphore(max(args.max_concurrency, 1))
        self.started = time.monotonic()
        self.lag: list[float] = []

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    async def request(self, session: aiohttp.ClientSession, path: str, body: dict[str, Any]) -> RequestRecord:
        self.in_flight += 1
        try:
            record, reply = await send(session, self.url + path, body, timeout_s=self.args.request_timeout)
        finally:
            self.in_flight -= 1
            self.slots.release()
        record.reply = reply
        self.records.append(record)
        return record

    async def progress(self) -> None:
        if self.args.quiet:
            return
        tty = sys.stderr.isatty()
        while True:
            await asyncio.sleep(0.5 if tty else 5.0)
            line = progress_line(self.records, elapsed_s=self.elapsed(), in_flight=self.in_flight)
            sys.stderr.write(("\r" + line + "\033[K") if tty else line + "\n")
            sys.stderr.flush()


async def _replay(run: _Run, session: aiohttp.ClientSession) -> dict[str, Any]:
    args = run.args
    tasks: list[asyncio.Task[RequestRecord]] = []
    first: float | None = None
    sent = 0
    for req in read_trace(args.trace, limit=args.max_requests, every=args.sample):
        req = scale_tokens(req, factor=args.token_scale, output_factor=args.output_scale)
        first = req.timestamp_ms if first is None else first
        at = (req.timestamp_ms - first) / 1000 * args.time_scale
        if at >= args.duration:
            break
        delay = at - run.elapsed()
        if delay > 0:
            await asyncio.sleep(delay)
        await run.slots.acquire()
        run.lag.append(max(run.elapsed() - at, 0.0))
        tasks.append(asyncio.create_task(run.request(session, "/v1/completions", req.body(model=args.model))))
        sent += 1
    if tasks:
        await asyncio.gather(*tasks)
    return {"mode": "trace", "trace": str(args.trace), "time_scale": args.time_scale, "sample": args.sample,
            "token_scale": args.token_scale, "output_scale": args.output_scale}


async def _sessions(run: _Run, session: aiohttp.ClientSession) -> dict[str, Any]:
    args = run.args
    steps = (parse_steps(args.rate_steps, base_rate=args.rate) if args.rate_steps
             else [RateStep(args.rate, args.duration)])
    shape = parse_shape(args.rate_shape, base_rate=args.rate) if args.rate_shape else None
    rng = random.Random(args.seed)
    system = text(args.system_tokens, seed=args.seed)
    idle: asyncio.Queue[Session] = asyncio.Queue()
    opened = finished = 0
    total_turns = args.sessions * args.turns
    tasks: set[asyncio.Task[None]] = set()
    sent = 0
    all_done = asyncio.Event()

    async def turn(s: Session) -> None:
        nonlocal finished
        record = await run.request(session, "/v1/chat/completions",
                                   s.next_body(model=args.model, max_tokens=args.output_tokens))
        if record.ok and s.turns + 1 < args.turns:
            s.answered(record.reply)
            idle.put_nowait(s)
        else:
            # Done, or a failed turn: a conversation cannot go on without its answer.
            finished += 1
            if finished >= args.sessions:
                all_done.set()

    next_at = 0.0
    limit = args.max_requests if args.max_requests is not None else total_turns
    while sent < min(limit, total_turns) and not all_done.is_set():
        rate = shape.rate_at(next_at) if shape is not None else rate_at(steps, next_at)
        if rate is None or next_at >= args.duration:
            break
        delay = next_at - run.elapsed()
        if delay > 0:
            await asyncio.sleep(delay)
        if idle.empty() and opened < args.sessions:
            s: Session | None = Session(index=opened, system=system, seed=args.seed + opened,
                                        user_chars=args.user_tokens)
            opened += 1
        else:
            getter = asyncio.create_task(idle.get())
            done_wait = asyncio.create_task(all_done.wait())
            await asyncio.wait({getter, done_wait}, return_when=asyncio.FIRST_COMPLETED,
                               timeout=max(args.duration - run.elapsed(), 0.0))
            done_wait.cancel()
            if not getter.done():
                getter.cancel()
                break
            s = getter.result()
        assert s is not None
        await run.slots.acquire()
        run.lag.append(max(run.elapsed() - next_at, 0.0))
        task = asyncio.create_task(turn(s))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
        sent += 1
        next_at += rng.expovariate(rate)
    if tasks:
        await asyncio.gather(*list(tasks))
    return {"mode": "sessions", "sessions": args.sessions, "sessions_opened": opened, "turns": args.turns,
            "rate": args.rate, "rate_steps": [[s.rate, s.seconds] for s in steps], "rate_shape": args.rate_shape,
            "system_tokens": args.system_tokens, "user_tokens": args.user_tokens, "output_tokens_max": args.output_tokens}


async def run_load(args: argparse.Namespace, *, on_summary: Callable[[dict[str, Any]], None] | None = None,
                   records: list[RequestRecord] | None = None) -> dict[str, Any]:
    """Run the workload ``args`` describe and return its summary; ``records`` gets the per-request records."""
    parts = urlsplit(args.url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise SystemExit(f"--url {args.url!r}: give http://HOST:PORT")
    run = _Run(url=args.url, args=args)
    connector = aiohttp.TCPConnector(limit=max(args.max_concurrency, 1))
    reporter = asyncio.create_task(run.progress())
    try:
        async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as session:
            extra = await (_replay(run, session) if args.trace else _sessions(run, session))
    finally:
        reporter.cancel()
        if not args.quiet and sys.stderr.isatty():
            sys.stderr.write("\n")
    duration = run.elapsed()
    lag = sorted(run.lag)
    extra.update(url=args.url, arrival_lag_s=lag[len(lag) // 2] if lag else None)
    summary = summarize(run.records, duration_s=duration, extra=extra)
    if records is not None:
        records.extend(run.records)
    if on_summary:
        on_summary(summary)
    return summary


def run(args: argparse.Namespace) -> int:
    setup_logging(logging.WARNING)
    for name in ("max_requests", "sessions", "turns", "max_concurrency"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be at least 1")
    if (args.time_scale <= 0 or args.duration <= 0 or args.rate <= 0 or args.token_scale <= 0
            or (args.output_scale is not None and args.output_scale <= 0)):
        raise SystemExit("--time-scale, --duration, --rate, --token-scale and --output-scale must be positive")
    if args.sample < 1:
        raise SystemExit("--sample must be at least 1")
    if args.rate_shape and args.rate_steps:
        raise SystemExit("--rate-shape and --rate-steps: give one of them")
    try:
        summary = asyncio.run(run_load(args))
    except TraceError as exc:
        raise SystemExit(f"trace: {exc}") from None
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    text_out = json.dumps(summary, indent=2, sort_keys=True)
    if args.json:
        args.json.write_text(text_out + "\n")
    print(text_out)
    return 0 if summary["failed_requests"] == 0 else 1
