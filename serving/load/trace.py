"""Traces in the field's formats, parsed and checked, turned into request bodies; and built-in rate shapes.

Two formats, told apart by the file's first line:

- Mooncake JSONL: a line is ``{"timestamp": ms, "input_length": tokens,
  "output_length": tokens, "hash_ids": [block ids]}`` (the FAST'25 release;
  one block is 512 tokens and ``len(hash_ids) == ceil(input_length / 512)``).
  Requests sharing leading block ids share that prefix.
- Azure LLM inference CSV (the 2023 release): a header
  ``TIMESTAMP,ContextTokens,GeneratedTokens`` then one row per request, the
  timestamp as ``2023-11-16 18:17:03.9799600``. It carries no prefix ids, so
  every request gets blocks of its own (fresh ids from a counter): no two
  requests share a prefix, the cache's worst case, and the prompt is exactly
  ``ContextTokens`` long.

A bad line is an error naming the line and field, never silently skipped: a
replay that quietly drops requests reports numbers for a different workload.
``every_nth`` keeps every N-th request (the rate divided by N, the shape kept).

Shapes (``parse_shape``) are rates over time for the sessions mode: a
sinusoid between a low and a high rate, and a linear ramp.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from daybreak.errors import DaybreakError
from daybreak.serving.prompt import TRACE_BLOCK_TOKENS

# Bounds that no real trace line comes near; beyond them the line is hostile or corrupt.
MAX_LINE_BYTES = 4 << 20
MAX_INPUT_TOKENS = 2_000_000
MAX_OUTPUT_TOKENS = 1_000_000

# The traces kept in the repository (traces/README.md: where each comes from and its licence), found
# from this file's place in the source tree: a checkout (and its editable install) has them, a wheel does not.
TRACES_DIR = Path(__file__).resolve().parents[2] / "traces"
# The Mooncake FAST'25 synthetic trace: the default workload of the demo and `daybreak bench serving`.
SYNTHETIC_TRACE = TRACES_DIR / "synthetic_trace.jsonl"


class TraceError(DaybreakError, ValueError):
    """A trace line is malformed; the message names the file, line and field."""


@dataclass(frozen=True)
class TraceRequest:
    """One request of a trace."""

    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]

    def body(self, *, model: str, stream: bool = True) -> dict[str, Any]:
        """The OpenAI completions body: the ``hash_ids`` prompt extension and ``max_tokens: output_length``."""
        body: dict[str, Any] = {"model": model, "hash_ids": list(self.hash_ids), "input_length": self.input_length,
                                "max_tokens": self.output_length, "stream": stream}
        if stream:
            body["stream_options"] = {"include_usage": True}
        return body


def _int(obj: dict[str, Any], name: str, where: str, *, low: int, high: int) -> int:
    value = obj.get(name)
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise TraceError(f"{where}: {name} must be an integer in {low}..{high}, got {value!r}")
    return value


def parse_line(line: str, *, where: str = "line", block_tokens: int = TRACE_BLOCK_TOKENS) -> TraceRequest:
    """One trace line; raises TraceError naming ``where`` and the field."""
    try:
        obj = json.loads(line)
    except ValueError as exc:
        raise TraceError(f"{where}: not JSON ({exc})") from None
    if not isinstance(obj, dict):
        raise TraceError(f"{where}: must be a JSON object")
    ts = obj.get("timestamp")
    if not isinstance(ts, int | float) or isinstance(ts, bool) or not math.isfinite(ts) or ts < 0:
        raise TraceError(f"{where}: timestamp must be a non-negative number of milliseconds, got {ts!r}")
    input_length = _int(obj, "input_length", where, low=1, high=MAX_INPUT_TOKENS)
    output_length = _int(obj, "output_length", where, low=1, high=MAX_OUTPUT_TOKENS)
    hash_ids = obj.get("hash_ids")
    if not isinstance(hash_ids, list) or not all(isinstance(h, int) and not isinstance(h, bool) and
                                                 0 <= h < 2**32 // block_tokens for h in hash_ids):
        raise TraceError(f"{where}: hash_ids must be a list of non-negative block ids below 2**32/{block_tokens}")
    if len(hash_ids) != math.ceil(input_length / block_tokens):
        raise TraceError(f"{where}: {len(hash_ids)} hash_ids do not cover input_length {input_length} "
                         f"in blocks of {block_tokens} (need {math.ceil(input_length / block_tokens)})")
    return TraceRequest(float(ts), input_length, output_length, tuple(hash_ids))


AZURE_HEADER = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
# Fresh block ids for Azure rows wrap below this: the prompt's token ids must stay under 2**32.
_MAX_BLOCK_ID = 2**32 // TRACE_BLOCK_TOKENS


def trace_format(path: Path | str) -> str:
    """``"azure"`` when the first line is the Azure CSV header, else ``"mooncake"`` (JSONL)."""
    with open(path, "rb") as f:
        first = f.readline(MAX_LINE_BYTES).decode("utf-8", errors="replace").strip().lstrip("\ufeff")
    if first.split(",")[:1] == ["TIMESTAMP"]:
        return "azure"
    return "mooncake"


def _azure_time_ms(text: str, where: str) -> float:
    # Seven fractional digits (100 ns ticks): more than datetime parses, so the fraction is read apart.
    whole, _, fraction = text.strip().partition(".")
    try:
        at = datetime.strptime(whole, "%Y-%m-%d %H:%M:%S")
        frac = float("0." + fraction) if fraction else 0.0
    except ValueError:
        raise TraceError(f"{where}: TIMESTAMP must look like 2023-11-16 18:17:03.9799600, got {text!r}") from None
    if fraction and not fraction.isdigit():
        raise TraceError(f"{where}: TIMESTAMP must look like 2023-11-16 18:17:03.9799600, got {text!r}")
    return (at.timestamp() + frac) * 1000.0


def parse_azure_row(line: str, *, where: str, first_block: int,
                    block_tokens: int = TRACE_BLOCK_TOKENS) -> TraceRequest:
    """One Azure CSV row; its blocks get ids ``first_block ..`` (no prefix shared with any other request)."""
    cells = line.split(",")
    if len(cells) != 3:
        raise TraceError(f"{where}: want 3 fields {','.join(AZURE_HEADER)}, got {len(cells)}")
    ts = _azure_time_ms(cells[0], where)
    numbers = []
    for name, cell, high in (("ContextTokens", cells[1], MAX_INPUT_TOKENS),
                             ("GeneratedTokens", cells[2], MAX_OUTPUT_TOKENS)):
        try:
            value = int(cell)
        except ValueError:
            raise TraceError(f"{where}: {name} must be an integer, got {cell.strip()!r}") from None
        if not 1 <= value <= high:
            raise TraceError(f"{where}: {name} must be an integer in 1..{high}, got {value}")
        numbers.append(value)
    blocks = math.ceil(numbers[0] / block_tokens)
    ids = tuple((first_block + i) % (2**32 // block_tokens) for i in range(blocks))
    return TraceRequest(ts, numbers[0], numbers[1], ids)


def read_trace(path: Path | str, *, limit: int | None = None, every: int = 1) -> Iterator[TraceRequest]:
    """The requests of a trace (Mooncake JSONL or Azure CSV) in file order, every ``every``-th, at most ``limit``.

    Blank lines are skipped; ``every`` counts requests, not lines (``every_nth``).
    """
    if every < 1:
        raise TraceError(f"--sample must be at least 1, got {every}")
    azure = trace_format(path) == "azure"
    count = seen = 0
    next_block = 0
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            if limit is not None and count >= limit:
                return
            if len(raw) > MAX_LINE_BYTES:
                raise TraceError(f"{path}:{number}: line longer than {MAX_LINE_BYTES} bytes")
            line = raw.decode("utf-8", errors="replace").strip()
            if not line:
                continue
            where = f"{path}:{number}"
            if azure:
                if number == 1:
                    header = tuple(c.strip().lstrip("\ufeff") for c in line.split(","))
                    if header != AZURE_HEADER:
                        raise TraceError(f"{where}: Azure header must be {','.join(AZURE_HEADER)}, got {line!r}")
                    continue
                req = parse_azure_row(line, where=where, first_block=next_block)
                next_block = (next_block + len(req.hash_ids)) % _MAX_BLOCK_ID
            else:
                req = parse_line(line, where=where)
            seen += 1
            if (seen - 1) % every:
                continue
            yield req
            count += 1


def every_nth(requests: Iterable[TraceRequest], *, every: int) -> list[TraceRequest]:
    """Every ``every``-th request, from the first: the rate divided by ``every``, the shape over time kept."""
    if every < 1:
        raise ValueError(f"every must be at least 1, got {every}")
    return [r for i, r in enumerate(requests) if i % every == 0]


def scale_tokens(req: TraceRequest, *, factor: float, output_factor: float | None = None,
                 block_tokens: int = TRACE_BLOCK_TOKENS) -> TraceRequest:
    """The request with ``factor`` x its prompt and ``output_factor`` (default: ``factor``) x its output tokens,
    at least one each; the prompt keeps its leading blocks, so requests that shared a prefix still share
    its (shorter) start."""
    output_factor = factor if output_factor is None else output_factor
    if factor == 1.0 and output_factor == 1.0:
        return req
    tokens = max(1, round(req.input_length * factor))
    output = max(1, round(req.output_length * output_factor))
    return TraceRequest(req.timestamp_ms, tokens, output, req.hash_ids[: math.ceil(tokens / block_tokens)])


def busiest_rate(times_s: Iterable[float], *, window_s: float) -> float:
    """The most requests in any ``window_s`` span (starting at a request) over the span: requests per second."""
    ts = sorted(times_s)
    best, lo = 0, 0
    for hi, t in enumerate(ts):
        while ts[lo] < t - window_s:
            lo += 1
        best = max(best, hi - lo + 1)
    return best / window_s if window_s > 0 else 0.0


# -- shapes ------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Shape:
    """A rate over time (requests per second at ``t`` seconds): a sinusoid or a ramp."""

    kind: str  # "sine" or "ramp"
    low: float  # sine: the trough; ramp: the rate at t = 0
    high: float  # sine: the crest; ramp: the rate at t >= seconds
    seconds: float  # sine: the period; ramp: how long it climbs (or falls)

    def rate_at(self, t: float) -> float:
        if self.kind == "sine":
            # Starts at the trough, so a run opens at low load and the first rising edge is the test.
            return self.low + (self.high - self.low) * (1 - math.cos(2 * math.pi * t / self.seconds)) / 2
        return self.low + (self.high - self.low) * min(max(t / self.seconds, 0.0), 1.0)

    @property
    def mean(self) -> float:
        """The mean rate over a sine period or the ramp's climb."""
        return (self.low + self.high) / 2


def parse_shape(spec: str, *, base_rate: float) -> Shape:
    """``sine:LOW:HIGH:PERIODs`` or ``ramp:FROM:TO:SECONDSs``; a rate ending in ``x`` is a multiple of
    ``base_rate`` (``sine:1x:4x:60s``), else requests per second."""
    m = re.fullmatch(r"(sine|ramp):(\d+(?:\.\d+)?)(x?):(\d+(?:\.\d+)?)(x?):(\d+(?:\.\d+)?)s?", spec.strip())
    if not m:
        raise ValueError(f"--rate-shape {spec!r}: write sine:LOW:HIGH:PERIODs or ramp:FROM:TO:SECONDSs, "
                         "e.g. sine:1x:4x:60s")
    kind = m.group(1)
    low = float(m.group(2)) * (base_rate if m.group(3) else 1.0)
    high = float(m.group(4)) * (base_rate if m.group(5) else 1.0)
    seconds = float(m.group(6))
    if seconds <= 0:
        raise ValueError(f"--rate-shape {spec!r}: the period or ramp length must be positive")
    if kind == "sine" and not 0 < low <= high:
        raise ValueError(f"--rate-shape {spec!r}: a sine needs 0 < LOW <= HIGH")
    if kind == "ramp" and (low <= 0 or high <= 0):
        raise ValueError(f"--rate-shape {spec!r}: a ramp's rates must be positive")
    return Shape(kind, low, high, seconds)


def sample_by_root(requests: Iterable[TraceRequest], *, every: int) -> list[TraceRequest]:
    """The requests whose first block id is a multiple of ``every``: a 1/every sample that keeps reuse.

    Requests sharing a prefix share its first block, so a prefix tree (a conversation, an agent's
    shared system prompt) is kept or dropped whole: hit rates stay close to the full trace's while
    the request count and the working set shrink by about ``every``.
    """
    if every < 1:
        raise ValueError(f"every must be at least 1, got {every}")
    return [r for r in requests if r.hash_ids and r.hash_ids[0] % every == 0]
