"""The offline bound: a trace's hash_ids replayed through an LRU cache of the pool's capacity.

Prefix semantics, as the serving path has them: a request reuses its leading
blocks up to the first one the cache lacks (chained keys: a block after a miss
is useless even if present), then every full block of the prompt is touched
(inserted or made most recent). The trailing partial block is never cached,
as in the engines. The token-weighted hit rate is what the load summary's
``hit_rate`` measures, so the two compare directly.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

from daybreak.serving.load.trace import TraceRequest
from daybreak.serving.prompt import TRACE_BLOCK_TOKENS


@dataclass(frozen=True)
class LRUResult:
    """What the LRU replay found."""

    requests: int
    prompt_tokens: int
    hit_tokens: int
    blocks: int
    hit_blocks: int
    capacity_blocks: int

    @property
    def hit_rate(self) -> float | None:
        """Fraction of prompt tokens that were cache hits."""
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else None


def lru_bound(requests: Iterable[TraceRequest], *, capacity_blocks: int,
              block_tokens: int = TRACE_BLOCK_TOKENS) -> LRUResult:
    """Replay ``requests`` in order through an LRU of ``capacity_blocks`` trace blocks."""
    if capacity_blocks < 0:
        raise ValueError(f"capacity_blocks must be >= 0, got {capacity_blocks}")
    cache: OrderedDict[int, None] = OrderedDict()
    n = prompt = hit_tokens = blocks = hit_blocks = 0
    for req in requests:
        n += 1
        prompt += req.input_length
        full = req.input_length // block_tokens
        ids = req.hash_ids[:full]
        blocks += len(ids)
        lead = 0
        for h in ids:
            if h not in cache:
                break
            lead += 1
        hit_blocks += lead
        hit_tokens += lead * block_tokens
        for h in ids:
            if h in cache:
                cache.move_to_end(h)
            elif capacity_blocks > 0:
                cache[h] = None
                if len(cache) > capacity_blocks:
                    cache.popitem(last=False)
    return LRUResult(requests=n, prompt_tokens=prompt, hit_tokens=hit_tokens, blocks=blocks, hit_blocks=hit_blocks,
                     capacity_blocks=capacity_blocks)
