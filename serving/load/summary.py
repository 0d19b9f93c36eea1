"""What one load run measured: per-request records in, the JSON summary and the progress line out.

Percentiles are linear interpolation between closest ranks (numpy's default),
computed over successful requests only; an empty set gives ``null``, never 0.
``hit_rate`` is the fraction of prompt tokens whose KV came from a cache (pool
or engine-local) instead of being computed: the sum of ``usage
.prompt_tokens_details.cached_tokens`` over the sum of ``prompt_tokens``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (0..100) of ``values`` by linear interpolation; None when empty."""
    if not values:
        return None
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be in 0..100, got {q}")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    low = math.floor(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


@dataclass
class RequestRecord:
    """One request as the load generator saw it."""

    sent_at: float
    ok: bool = False
    error: str = ""
    ttft_s: float | None = None
    e2e_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    pool_hit_tokens: int = 0
    local_hit_tokens: int = 0
    computed_tokens: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    blocks_corrupt: int = 0
    reply: str = ""
    """The generated text (sessions append it to the history)."""

    def take_usage(self, usage: Any) -> None:
        """Read an OpenAI ``usage`` (with the ``daybreak`` extension when present)."""
        if not isinstance(usage, dict):
            return
        self.prompt_tokens = _count(usage.get("prompt_tokens"))
        self.output_tokens = _count(usage.get("completion_tokens")) or self.output_tokens
        details = usage.get("prompt_tokens_details")
        if isinstance(details, dict):
            self.cached_tokens = _count(details.get("cached_tokens"))
        ext = usage.get("daybreak")
        if isinstance(ext, dict):
            self.pool_hit_tokens = _count(ext.get("pool_hit_tokens"))
            self.local_hit_tokens = _count(ext.get("local_hit_tokens"))
            self.computed_tokens = _count(ext.get("computed_tokens"))
            self.bytes_read = _count(ext.get("bytes_read"))
            self.bytes_written = _count(ext.get("bytes_written"))
            self.blocks_corrupt = _count(ext.get("blocks_corrupt"))


def _count(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0


def _ratio(num: int, den: int) -> float | None:
    return num / den if den else None


def summarize(records: Sequence[RequestRecord], *, duration_s: float, extra: dict[str, Any] | None = None
              ) -> dict[str, Any]:
    """The JSON summary of a run (field names are the interface: see docs/serving.md)."""
    ok = [r for r in records if r.ok]
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    e2e = [r.e2e_s for r in ok if r.e2e_s is not None]
    itl = [x for r in ok for x in r.itl_s]
    prompt = sum(r.prompt_tokens for r in ok)
    output = sum(r.output_tokens for r in ok)
    errors: dict[str, int] = {}
    for r in records:
        if not r.ok:
            errors[r.error or "unknown"] = errors.get(r.error or "unknown", 0) + 1
    out: dict[str, Any] = {
        "requests": len(records),
        "completed_requests": len(ok),
        "failed_requests": len(records) - len(ok),
        "errors": errors,
        "duration_s": duration_s,
        "requests_per_s": len(ok) / duration_s if duration_s > 0 else None,
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p90_s": percentile(ttft, 90),
        "ttft_p99_s": percentile(ttft, 99),
        "itl_p50_s": percentile(itl, 50),
        "itl_p90_s": percentile(itl, 90),
        "e2e_p50_s": percentile(e2e, 50),
        "e2e_p90_s": percentile(e2e, 90),
        "prompt_tokens": prompt,
        "output_tokens": output,
        "output_tokens_per_s": output / duration_s if duration_s > 0 else None,
        "cached_tokens": sum(r.cached_tokens for r in ok),
        "hit_rate": _ratio(sum(r.cached_tokens for r in ok), prompt),
        "pool_hit_rate": _ratio(sum(r.pool_hit_tokens for r in ok), prompt),
        "local_hit_rate": _ratio(sum(r.local_hit_tokens for r in ok), prompt),
        "computed_tokens": sum(r.computed_tokens for r in ok),
        "bytes_read": sum(r.bytes_read for r in ok),
        "bytes_written": sum(r.bytes_written for r in ok),
        "blocks_corrupt": sum(r.blocks_corrupt for r in ok),
    }
    if extra:
        out.update(extra)
    return out


def progress_line(records: Sequence[RequestRecord], *, elapsed_s: float, in_flight: int) -> str:
    """One line of live progress: requests/s, TTFT p50, hit rate, failures."""
    done = [r for r in records if r.ok]
    failed = sum(1 for r in records if not r.ok)
    recent = [r.ttft_s for r in done[-200:] if r.ttft_s is not None]
    p50 = percentile(recent, 50)
    prompt = sum(r.prompt_tokens for r in done)
    hit = _ratio(sum(r.cached_tokens for r in done), prompt)
    rate = len(done) / elapsed_s if elapsed_s > 0 else 0.0
    return (f"t={elapsed_s:6.1f}s done={len(done)} failed={failed} in_flight={in_flight} req/s={rate:.2f} "
            f"ttft_p50={'-' if p50 is None else f'{p50 * 1000:.0f}ms'} "
            f"hit_rate={'-' if hit is None else f'{hit:.1%}'}")
