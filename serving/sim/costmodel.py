"""How long the simulated engine's work takes: the cost model (pure arithmetic, no I/O, no clock).

The engine never computes attention; it sleeps for what this model says the
work would take on the accelerator, so queues, batches, TTFT and ITL behave
like a real engine's while the KV bytes it moves are real. Defaults are
calibrated to the example layout (Llama-3.1-8B: 32 layers, 8 KV heads, head
size 128, bf16, so 128 KiB of KV per token) on one H100-class accelerator;
docs/serving.md explains each number.

Units: seconds, tokens and bytes throughout; ``time_scale`` multiplies every
duration this model returns (0.1 runs ten times faster than modelled).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

# Llama-3.1-8B, bf16, 16-token blocks: 2 x 32 x 8 x 128 x 2 bytes x 16 tokens.
EXAMPLE_BLOCK_BYTES = 2 * 32 * 8 * 128 * 2 * 16


@dataclass(frozen=True)
class PrefillChunk:
    """One sequence's share of a step: ``tokens`` new prompt tokens after ``context`` tokens already in KV."""

    tokens: int
    context: int


@dataclass(frozen=True)
class CostModel:
    """The knobs of the cost model; every default is explained in docs/serving.md (Simulated engine)."""

    step_base_seconds: float = 0.010
    """Fixed cost of one forward step: reading the 16 GB of weights from HBM (~5 ms at 3.35 TB/s) plus
    scheduling and kernel launches. It is the whole decode step at batch 1 with a short context."""
    decode_per_sequence_seconds: float = 0.00015
    """Added per sequence in the decode batch (sampling, per-row matmul work beyond the weight read)."""
    decode_per_context_token_seconds: float = 4.0e-8
    """Added per token of context summed over the decode batch: reading its 128 KiB of KV at HBM speed."""
    prefill_per_token_seconds: float = 1.0e-4
    """Linear prefill cost per new prompt token (2 x 8e9 FLOP at ~160 TFLOP/s effective: 10k tokens/s)."""
    prefill_attention_pair_seconds: float = 1.3e-9
    """Attention cost per (new token, earlier token) pair: 32 layers x 32 query heads x 128 x 4 FLOP
    at ~400 TFLOP/s. It makes prefill superlinear in context (a 32k prompt costs ~3.9 s, not 3.2 s)."""
    load_bandwidth_bytes_per_second: float = 25.0e9
    """Pool-to-accelerator bandwidth for blocks found in the pool (200 Gb/s RDMA, or PCIe 5 x16 effective)."""
    load_per_block_seconds: float = 2.0e-5
    """Fixed cost per loaded block (descriptor, completion, scatter into the paged KV cache)."""
    time_scale: float = 1.0
    """Multiplies every duration returned (0.01 replays a trace a hundred times faster than modelled)."""

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"cost model: {field.name} must be a non-negative number, got {value!r}")
        if self.load_bandwidth_bytes_per_second <= 0:
            raise ValueError("cost model: load_bandwidth_bytes_per_second must be positive")

    def prefill_seconds(self, tokens: int, *, context: int = 0) -> float:
        """Compute for ``tokens`` new prompt tokens whose KV follows ``context`` tokens already present."""
        if tokens <= 0:
            return 0.0
        pairs = tokens * (context + tokens / 2)
        return (self.prefill_per_token_seconds * tokens + self.prefill_attention_pair_seconds * pairs) * self.time_scale

    def decode_seconds(self, *, batch: int, context_tokens: int) -> float:
        """A decode-only step for ``batch`` sequences holding ``context_tokens`` tokens of KV in all."""
        return self.step_seconds(decode_batch=batch, decode_context_tokens=context_tokens, chunks=())

    def step_seconds(self, *, decode_batch: int, decode_context_tokens: int,
                     chunks: Sequence[PrefillChunk]) -> float:
        """One scheduler step: one token for each of ``decode_batch`` sequences plus the prefill ``chunks``.

        A mixed step pays the fixed step cost once (one forward pass carries both), then the decode
        rows, then each prefill chunk's compute.
        """
        if decode_batch <= 0 and not chunks:
            return 0.0
        seconds = (self.step_base_seconds + self.decode_per_sequence_seconds * max(decode_batch, 0)
                   + self.decode_per_context_token_seconds * max(decode_context_tokens, 0))
        seconds *= self.time_scale
        return seconds + sum(self.prefill_seconds(c.tokens, context=c.context) for c in chunks)

    def load_seconds(self, *, blocks: int, block_bytes: int) -> float:
        """Moving ``blocks`` blocks of ``block_bytes`` each from the pool into the accelerator."""
        if blocks <= 0:
            return 0.0
        per_block = block_bytes / self.load_bandwidth_bytes_per_second + self.load_per_block_seconds
        return blocks * per_block * self.time_scale

    def replace(self, **changes: float) -> CostModel:
        """A copy with some knobs changed."""
        return dataclasses.replace(self, **changes)


def knob_names() -> list[str]:
    """The CostModel field names, in declaration order (the CLI makes one flag of each)."""
    return [f.name for f in dataclasses.fields(CostModel)]
