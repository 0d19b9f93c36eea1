"""OpenAI wire shapes shared by the sim engine and the router: SSE framing, response and chunk bodies, usage.

Streaming is Server-Sent Events: each event is ``data: <json>\\n\\n`` and the
stream ends with ``data: [DONE]\\n\\n``. ``usage`` carries the standard
counts plus ``prompt_tokens_details.cached_tokens`` and the Daybreak
extension ``daybreak`` (see ``DAYBREAK_USAGE_FIELDS``).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator, Mapping
from typing import Any, Literal

from daybreak.errors import DaybreakError

Kind = Literal["completion", "chat"]

DONE = b"data: [DONE]\n\n"
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
# The extension's counters: summed over the steps of a request by the router.
DAYBREAK_USAGE_FIELDS = ("pool_hit_tokens", "local_hit_tokens", "computed_tokens", "bytes_read",
                         "bytes_written", "blocks_checked", "blocks_corrupt")


class RequestError(DaybreakError, ValueError):
    """A request field is missing or malformed; the message names the field (answered with 400)."""


def sse_data(data: bytes) -> bytes:
    """One SSE event carrying ``data``, JSON already encoded (an engine's chunk that the router relays as is)."""
    return b"data: " + data + b"\n\n"


def sse(payload: Mapping[str, Any], *, compact: bool = True) -> bytes:
    """One SSE event carrying ``payload`` as JSON.

    ``compact=False`` spaces the JSON as ``json.dumps`` does by default: the router's own events (its
    mid-stream error, the usage chunk that ends a relayed stream) have always been written that way.
    """
    separators = (",", ":") if compact else None
    return sse_data(json.dumps(payload, separators=separators).encode())


def parse_sse(stream: bytes) -> Iterator[dict[str, Any]]:
    """The JSON payloads of an SSE body up to ``[DONE]`` (for clients and tests)."""
    for event in stream.split(b"\n\n"):
        event = event.strip()
        if not event.startswith(b"data:"):
            continue
        data = event[5:].strip()
        if data == b"[DONE]":
            return
        yield json.loads(data)


def usage_dict(*, prompt_tokens: int, completion_tokens: int, cached_tokens: int,
               daybreak: Mapping[str, int] | None = None) -> dict[str, Any]:
    """The ``usage`` object: counts, ``prompt_tokens_details.cached_tokens`` and the ``daybreak`` extension."""
    out: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }
    if daybreak is not None:
        out["daybreak"] = {name: int(daybreak.get(name, 0)) for name in DAYBREAK_USAGE_FIELDS}
    return out


def request_id(kind: Kind) -> str:
    """A fresh response id in OpenAI's style (``cmpl-...`` / ``chatcmpl-...``)."""
    return ("cmpl-" if kind == "completion" else "chatcmpl-") + uuid.uuid4().hex


def response_body(*, kind: Kind, rid: str, model: str, text: str, finish_reason: str,
                  usage: Mapping[str, Any], created: int | None = None) -> dict[str, Any]:
    """A non-streamed response of ``kind``."""
    choice: dict[str, Any]
    if kind == "completion":
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
    else:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                  "finish_reason": finish_reason}
    return {"id": rid, "object": "text_completion" if kind == "completion" else "chat.completion",
            "created": created or int(time.time()), "model": model, "choices": [choice], "usage": dict(usage)}


def chunk_body(*, kind: Kind, rid: str, model: str, text: str | None, finish_reason: str | None = None,
               first: bool = False, created: int | None = None) -> dict[str, Any]:
    """One streamed chunk: ``text`` (None for an empty delta), ``finish_reason`` on the last one.

    Chat streams open with a delta carrying the assistant role (``first``), as OpenAI's do.
    """
    choice: dict[str, Any]
    if kind == "completion":
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
    else:
        delta: dict[str, Any] = {"role": "assistant"} if first else {}
        if text is not None:
            delta["content"] = text
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
    return {"id": rid, "object": "text_completion" if kind == "completion" else "chat.completion.chunk",
            "created": created or int(time.time()), "model": model, "choices": [choice]}


def usage_chunk(*, kind: Kind, rid: str, model: str, usage: Mapping[str, Any],
                created: int | None = None) -> dict[str, Any]:
    """The final chunk of a stream asked for usage (``stream_options.include_usage``): no choices."""
    return {"id": rid, "object": "text_completion" if kind == "completion" else "chat.completion.chunk",
            "created": created or int(time.time()), "model": model, "choices": [], "usage": dict(usage)}


def relayed_usage_chunk(template: Mapping[str, Any] | None, *, usage: Mapping[str, Any] | None) -> dict[str, Any]:
    """The final chunk of a relayed stream asked for usage: the engine's own usage chunk (``template``: its
    id, object, created, model and whatever else it carries, in its order) with ``usage`` in place of the
    engine's and no choices; a bare completion chunk when the engine sent none."""
    final = dict(template or {"object": "text_completion", "choices": []})
    final["usage"] = dict(usage) if usage is not None else None
    final["choices"] = []
    return final


def error_body(message: str, *, kind: str = "invalid_request_error", param: str | None = None,
               code: int | None = 400) -> dict[str, Any]:
    """OpenAI's error shape (the router answers with ``code`` None, the sim engine with the HTTP status)."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def stream_error_body(message: str, *, kind: str) -> dict[str, Any]:
    """The error event that ends a stream whose 200 already went out: message and type only."""
    return {"error": {"message": message, "type": kind}}


def stream_settings(body: Mapping[str, Any]) -> tuple[bool, bool]:
    """``(stream, include_usage)`` from a request body; raises RequestError naming a bad field."""
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise RequestError("stream must be true or false")
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not isinstance(options, dict):
            raise RequestError("stream_options must be an object")
        include_usage = options.get("include_usage", False)
        if not isinstance(include_usage, bool):
            raise RequestError("stream_options.include_usage must be true or false")
    return stream, include_usage


def max_tokens(body: Mapping[str, Any], *, default: int = 16, limit: int = 1 << 20,
               context_length: int | None = None, prompt_tokens: int = 0) -> int:
    """``max_tokens`` (or chat's ``max_completion_tokens``) as a positive int no larger than ``limit``.

    With ``context_length`` (the model's, in tokens) the output must also fit beside the prompt: a request
    asking for more is refused (RequestError, answered 400), as vLLM does, never silently capped, so a
    client learns the bound instead of getting a shorter answer than it asked for. Absent, the default is
    capped to what fits.
    """
    cap = limit
    if context_length is not None:
        room = context_length - prompt_tokens
        if room < 1:
            raise RequestError(f"prompt: {prompt_tokens} tokens leave no room for output in the model's context "
                               f"length of {context_length} tokens; send a shorter prompt")
        cap = min(cap, room)
    for name in ("max_tokens", "max_completion_tokens"):
        if body.get(name) is not None:
            value = body[name]
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise RequestError(f"{name} must be a positive integer, got {value!r}")
            if value > cap:
                if context_length is not None and cap < limit:
                    raise RequestError(f"{name}: {value} is more than the context leaves for output: the model's "
                                       f"context length {context_length} minus the prompt's {prompt_tokens} tokens "
                                       f"is {cap}; ask for at most {cap}")
                raise RequestError(f"{name} must be an integer in 1..{cap}, got {value!r}")
            return value
    return min(default, cap)


MAX_CACHE_SALT_CHARS = 1024


def cache_salt(body: Mapping[str, Any]) -> str | None:
    """The request's ``cache_salt`` (vLLM's extension: requests with different salts never share cached
    blocks), or None; raises RequestError naming the field when it is not a non-empty string."""
    value = body.get("cache_salt")
    if value is None:
        return None
    if not isinstance(value, str) or not 0 < len(value) <= MAX_CACHE_SALT_CHARS:
        raise RequestError(f"cache_salt must be a non-empty string of at most {MAX_CACHE_SALT_CHARS} characters")
    return value


CACHE_STATISTICS_FIELDS = ("prompt_tokens_details", "daybreak")
"""The parts of ``usage`` that say what a cache held: left out of replies unless the deployment asks."""


def without_cache_statistics(usage: Mapping[str, Any]) -> dict[str, Any]:
    """``usage`` without ``prompt_tokens_details`` (``cached_tokens``) and the ``daybreak`` counters."""
    return {k: v for k, v in usage.items() if k not in CACHE_STATISTICS_FIELDS}
