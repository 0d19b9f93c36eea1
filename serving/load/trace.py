"""Mooncake-format traces: one JSON object per line, parsed and checked, then turned into request bodies.

A line is ``{"timestamp": ms, "input_length": tokens, "output_length": tokens,
"hash_ids": [block ids]}`` (the FAST'25 release; one block is 512 tokens and
``len(hash_ids) == ceil(input_length / 512)``). A bad line is an error naming
the line and field, never silently skipped: a replay that quietly drops
requests reports numbers for a different workload.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
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


def read_trace(path: Path | str, *, limit: int | None = None) -> Iterator[TraceRequest]:
    """The requests of a JSONL trace in file order (blank lines skipped), at most ``limit`` of them."""
    count = 0
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            if limit is not None and count >= limit:
                return
            if len(raw) > MAX_LINE_BYTES:
                raise TraceError(f"{path}:{number}: line longer than {MAX_LINE_BYTES} bytes")
            line = raw.decode("utf-8", errors="replace").strip()
            if not line:
                continue
            yield parse_line(line, where=f"{path}:{number}")
            count += 1


def sample_by_root(requests: Iterable[TraceRequest], *, every: int) -> list[TraceRequest]:
    """The requests whose first block id is a multiple of ``every``: a 1/every sample that keeps reuse.

    Requests sharing a prefix share its first block, so a prefix tree (a conversation, an agent's
    shared system prompt) is kept or dropped whole: hit rates stay close to the full trace's while
    the request count and the working set shrink by about ``every``.
    """
    if every < 1:
        raise ValueError(f"every must be at least 1, got {every}")
    return [r for r in requests if r.hash_ids and r.hash_ids[0] % every == 0]
