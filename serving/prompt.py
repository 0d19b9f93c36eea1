"""What a request's prompt is, as every serving component sees it: tokens, block keys and block contents.

The router, the simulated engine and the load generator must agree on three
things without talking to each other, or the pool's hit rates mean nothing:

- **Tokens.** Text is tokenized byte-level (one token per UTF-8 byte, ids
  0..255); a chat request is first rendered with ``render_chat``; a prompt may
  also come as token ids, or as a Mooncake trace's ``hash_ids`` (one id per
  512-token block), which ``tokens_from_hash_ids`` expands into token ids so
  that equal hash ids give equal tokens and so equal block keys.
- **Block keys.** ``block_keys`` is the chained hash of ``daybreak.client``:
  key ``i`` depends on every token of blocks ``0..i``, so equal keys mean equal
  prefixes. The kvNamespace is not part of the key: the client prefixes it.
- **Block contents.** ``block_content`` is a pure function of (kvNamespace,
  key, size), so any reader checks by content that it got the right KV
  (``check_block``), and KV written under another namespace never matches.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from daybreak.client.hashing import block_hashes
from daybreak.errors import DaybreakError

# Mooncake's traces cut prompts into blocks of this many tokens (FAST'25 release).
TRACE_BLOCK_TOKENS = 512
_PATTERN_BYTES = 64


class PromptError(DaybreakError, ValueError):
    """The request's prompt is missing or malformed; the message names the field."""


def tokenize(text: str) -> list[int]:
    """Byte-level tokens: the UTF-8 bytes of ``text``."""
    return list(text.encode("utf-8"))


def detokenize(tokens: Iterable[int]) -> str:
    """Inverse of ``tokenize`` for ids 0..255; other ids (trace-made tokens) are dropped."""
    return bytes(t for t in tokens if 0 <= t < 256).decode("utf-8", errors="replace")


def render_chat(messages: Sequence[Mapping[str, Any]]) -> str:
    """The chat template: ``<|role|>\\ncontent\\n`` per message, then ``<|assistant|>\\n``."""
    parts = []
    for i, message in enumerate(messages):
        role, content = message.get("role"), message.get("content")
        if not isinstance(role, str) or not isinstance(content, str):
            raise PromptError(f"messages[{i}] needs string 'role' and 'content'")
        parts.append(f"<|{role}|>\n{content}\n")
    return "".join(parts) + "<|assistant|>\n"


def tokens_from_hash_ids(hash_ids: Sequence[int], input_length: int | None = None, *,
                         block_tokens: int = TRACE_BLOCK_TOKENS) -> list[int]:
    """Token ids for a trace request: block ``h`` becomes ``h * block_tokens + 0 .. + block_tokens - 1``.

    ``input_length`` (default: every block full) cuts the last block short, as in the trace.
    """
    if input_length is None:
        input_length = len(hash_ids) * block_tokens
    if not 0 <= input_length <= len(hash_ids) * block_tokens:
        raise PromptError(f"input_length {input_length} does not fit {len(hash_ids)} blocks of {block_tokens}")
    tokens: list[int] = []
    for h in hash_ids:
        if not isinstance(h, int) or h < 0 or (h + 1) * block_tokens > 2**32:
            raise PromptError(f"hash_ids holds {h!r}; ids must be non-negative ints below 2**32/{block_tokens}")
        tokens.extend(range(h * block_tokens, (h + 1) * block_tokens))
    return tokens[:input_length]


@dataclass(frozen=True)
class Prompt:
    """A parsed prompt: its token ids (what the engine "computes" and the keys hash)."""

    tokens: list[int]

    def keys(self, block_tokens: int) -> list[str]:
        """Block keys of every full block (a trailing partial block has none: it is never cached)."""
        return block_keys(self.tokens, block_tokens)


def parse_prompt(body: Mapping[str, Any]) -> Prompt:
    """The prompt of an OpenAI-style request body.

    ``/v1/completions``: ``prompt`` as a string or a list of token ids.
    ``/v1/chat/completions``: ``messages`` (rendered with ``render_chat``).
    Extension for trace replay: ``hash_ids`` (Mooncake-style block ids) with optional
    ``input_length``; it wins over ``prompt`` when both are given.
    """
    if "hash_ids" in body:
        hash_ids = body["hash_ids"]
        if not isinstance(hash_ids, list):
            raise PromptError("hash_ids must be a list of block ids")
        length = body.get("input_length")
        if length is not None and (not isinstance(length, int) or isinstance(length, bool)):
            raise PromptError("input_length must be an integer")
        return Prompt(tokens_from_hash_ids(hash_ids, length))
    if "messages" in body:
        messages = body["messages"]
        if not isinstance(messages, list) or not messages:
            raise PromptError("messages must be a non-empty list")
        return Prompt(tokenize(render_chat(messages)))
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return Prompt(tokenize(prompt))
    if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**32
                                        for t in prompt):
        return Prompt(list(prompt))
    raise PromptError("prompt must be a string or a list of token ids (or give messages, or hash_ids)")


def block_keys(tokens: Sequence[int], block_tokens: int, *, salt: str = "") -> list[str]:
    """Chained block keys (``daybreak.client.block_hashes``) of every full block of ``tokens``.

    ``salt`` is the request's ``cache_salt``: it seeds the chain, so every key differs between salts.
    """
    return block_hashes(tokens, block_tokens=block_tokens, salt=salt)


def _pattern(namespace: str, key: str) -> bytes:
    return hashlib.blake2b(f"{namespace}\0{key}".encode(), digest_size=_PATTERN_BYTES).digest()


def block_content(namespace: str, key: str, size: int) -> bytes:
    """The KV bytes of block ``key`` in ``namespace``: a 64-byte digest of both, repeated to ``size`` bytes."""
    pattern = _pattern(namespace, key)
    return (pattern * (size // _PATTERN_BYTES + 1))[:size]


def check_block(namespace: str, key: str, data: bytes | bytearray | memoryview) -> bool:
    """True when ``data`` is exactly ``block_content(namespace, key, len(data))``."""
    return bytes(data) == block_content(namespace, key, len(data)) if len(data) else True
