"""Who in the router's line for prefill room takes the next free slot: pure functions, no I/O.

With ``--prefill-concurrency`` requests wait in the router for a prefill pod with room (``Router._prefill_room``);
with ``--ttft-target`` the next free slot goes to the first request in line that can still have its first token
within the target, and to the first in line only when none can (docs/serving.md, "Who goes first").

"Can still make it" is its wait so far plus its own prefill: the prompt tokens the router expects prefill to
compute (the pool's prefix taken off) at the seconds per token of the recent prefill steps. A single mean step
time for every request, as before, let a long prompt that could no longer make it take the slot and hold the pod
past the target for the short ones behind it: `hack/trace_limit.py` replays the elastic bench's Azure sample
through this line, and with the mean step 14 requests miss on four prefill pods throughout (the bench measured
15 for fixed-peak) against 7 with each request's own prefill time.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

STEP_WEIGHT = 0.2  # of the newest prefill step in the running means


@dataclass(eq=False)
class Waiting:
    """A request in line for prefill room; compared by identity."""

    started: float
    """When it arrived (monotonic): its TTFT runs from here."""
    tokens: int = 0
    """Prompt tokens prefill is expected to compute for it (the pool's prefix taken off)."""


@dataclass
class PrefillTime:
    """How long a prefill step takes for a prompt, from the steps the router timed: running means of the step
    seconds and of the tokens each computed, their ratio the seconds per token. A prompt's step is its tokens at
    that rate (prefill time grows with the tokens computed; the per-step overhead is small against it)."""

    seconds: float | None = None
    tokens: float = 0.0

    def observe(self, took: float, tokens: int) -> None:
        if self.seconds is None:
            self.seconds, self.tokens = took, float(tokens)
            return
        self.seconds += STEP_WEIGHT * (took - self.seconds)
        self.tokens += STEP_WEIGHT * (tokens - self.tokens)

    def estimate(self, tokens: int) -> float:
        """Seconds of prefill for ``tokens`` computed: 0 before any step was timed, the mean step where the
        steps timed computed nothing (all found in a cache)."""
        if self.seconds is None:
            return 0.0
        if self.tokens <= 0:
            return self.seconds
        return self.seconds * tokens / self.tokens


def next_in_line(line: Iterable[Waiting], *, now: float, target: float | None, prefill: PrefillTime) -> Waiting:
    """Who takes the next free slot: with a ``target`` the first in ``line`` (arrival order) whose wait plus its
    own prefill is within it, else (or without a target) the first in line. ``line`` must not be empty."""
    first: Waiting | None = None
    for waiting in line:
        if first is None:
            first = waiting
            if target is None:
                break
        if target is not None and now - waiting.started + prefill.estimate(waiting.tokens) <= target:
            return waiting
    if first is None:
        raise ValueError("next_in_line: the line is empty")
    return first
