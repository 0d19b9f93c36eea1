"""Prefix-cache keys: chained hashes of a token sequence cut into a kvLayout's blocks.

Block ``i``'s key hashes block ``i-1``'s key together with block ``i``'s
tokens, so equal keys mean equal prefixes (not just equal blocks) and two
requests sharing a prompt prefix share exactly the keys of that prefix.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from typing import Any

_SEED = b"daybreak-kv-blocks-v1"


def block_hashes(tokens: Sequence[int], *, block_tokens: int | None = None, layout: Any = None,
                 salt: str = "") -> list[str]:
    """One hex key (32 hex digits) per *full* block of ``tokens``; a trailing partial block gets none.

    Give ``block_tokens`` (tokens per block) or ``layout`` (a kvLayout with ``block_tokens``).
    ``salt`` separates caches that must never share blocks (for example a LoRA adapter id).
    Token ids must fit in 32 bits.
    """
    size = block_tokens if block_tokens is not None else getattr(layout, "block_tokens", None)
    if not isinstance(size, int) or size < 1:
        raise ValueError(f"block_tokens must be a positive int (directly or as layout.block_tokens), got {size!r}")
    previous = hashlib.blake2b(_SEED + salt.encode(), digest_size=16).digest()
    keys = []
    for start in range(0, len(tokens) - size + 1, size):
        chunk = tokens[start:start + size]
        try:
            body = struct.pack(f"<{size}I", *chunk)
        except struct.error:
            raise ValueError(f"tokens[{start}:{start + size}] holds a value outside 0..2**32-1") from None
        previous = hashlib.blake2b(previous + body, digest_size=16).digest()
        keys.append(previous.hex())
    return keys
