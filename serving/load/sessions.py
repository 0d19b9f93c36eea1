"""Multi-turn agent-style sessions: a shared system prompt, a history that grows by each answer.

Every session starts with the same system prompt (so every session shares its
blocks), and each turn sends the whole conversation so far plus a new user
message: turn ``k``'s prompt starts with turn ``k-1``'s prompt and answer, so
its history is a prefix the pool already holds. Text is ASCII (one byte-level
token per character) and deterministic from ``seed``.

Arrivals follow a Poisson process whose rate follows ``steps`` (e.g.
``1x:30s,4x:30s,1x:30s`` of ``--rate``, or absolute ``2.5:30s``). An arrival
takes an idle session (one whose previous turn was answered), or opens a new
one while fewer than ``sessions`` were opened; otherwise it waits for one to
become idle, which the summary reports as ``arrival_lag_s`` (offered load the
sessions could not absorb).
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field
from typing import Any

_WORDS = ("agent", "tool", "call", "result", "plan", "step", "file", "search", "query", "answer", "code",
          "patch", "test", "build", "error", "retry", "observe", "think", "context", "memory", "cache", "block")


def text(n_chars: int, *, seed: int) -> str:
    """``n_chars`` of deterministic ASCII words."""
    rng = random.Random(seed)
    out: list[str] = []
    size = 0
    while size < n_chars:
        word = rng.choice(_WORDS)
        out.append(word)
        size += len(word) + 1
    return " ".join(out)[:n_chars]


@dataclass(frozen=True)
class RateStep:
    """Requests per second for ``seconds``."""

    rate: float
    seconds: float


def parse_steps(spec: str, *, base_rate: float) -> list[RateStep]:
    """``1x:30s,4x:30s`` (multiples of ``base_rate``) or ``2.5:30s`` (absolute requests/s)."""
    steps = []
    for part in [p.strip() for p in spec.split(",") if p.strip()]:
        m = re.fullmatch(r"(\d+(?:\.\d+)?)(x?):(\d+(?:\.\d+)?)s?", part)
        if not m:
            raise ValueError(f"rate step {part!r}: write RATE:SECONDS or MULTIPLEx:SECONDS, e.g. 4x:30s")
        value, mult, seconds = float(m.group(1)), m.group(2), float(m.group(3))
        rate = value * base_rate if mult else value
        if rate <= 0 or seconds <= 0:
            raise ValueError(f"rate step {part!r}: rate and duration must be positive")
        steps.append(RateStep(rate, seconds))
    if not steps:
        raise ValueError("rate steps: give at least one RATE:SECONDS")
    return steps


def rate_at(steps: list[RateStep], t: float) -> float | None:
    """The rate in force ``t`` seconds into the run; None after the last step."""
    for step in steps:
        if t < step.seconds:
            return step.rate
        t -= step.seconds
    return None


@dataclass
class Session:
    """One conversation: its messages so far and how many turns it has had."""

    index: int
    system: str
    seed: int
    user_chars: int
    messages: list[dict[str, str]] = field(default_factory=list)
    turns: int = 0

    def __post_init__(self) -> None:
        if not self.messages:
            self.messages = [{"role": "system", "content": self.system}]

    def next_body(self, *, model: str, max_tokens: int) -> dict[str, Any]:
        """The next turn's chat request: the history plus a new user message."""
        user = f"[session {self.index} turn {self.turns}] " + text(self.user_chars,
                                                                   seed=self.seed * 1_000_003 + self.turns)
        self.messages.append({"role": "user", "content": user})
        return {"model": model, "messages": list(self.messages), "max_tokens": max_tokens, "stream": True,
                "stream_options": {"include_usage": True}}

    def answered(self, reply: str) -> None:
        """Append the assistant's answer: the next turn's prompt extends this one."""
        self.messages.append({"role": "assistant", "content": reply})
        self.turns += 1
