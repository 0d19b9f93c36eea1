"""Sending requests and reading their streams: one ``RequestRecord`` per request, timed per token.

TTFT is request sent to the first chunk carrying text; ITL is the gap between
successive such chunks (role-only and finish-only chunks are not tokens); usage comes from the final chunk
(``stream_options.include_usage``). Every request has a timeout, the client
connects only to the URL it was given, and the number in flight is capped.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any

import aiohttp

from daybreak.serving.load.summary import RequestRecord

log = logging.getLogger(__name__)

_MAX_ERROR_BYTES = 4096


def _chunk_text(chunk: dict[str, Any]) -> str:
    out = []
    for c in chunk.get("choices") or []:
        if not isinstance(c, dict):
            continue
        if isinstance(c.get("text"), str):
            out.append(c["text"])
        delta = c.get("delta")
        if isinstance(delta, dict) and isinstance(delta.get("content"), str):
            out.append(delta["content"])
    return "".join(out)


async def send(session: aiohttp.ClientSession, url: str, body: dict[str, Any], *,
               timeout_s: float) -> tuple[RequestRecord, str]:
    """POST ``body`` to ``url`` (streamed or not) and time it; returns the record and the generated text."""
    record = RequestRecord(sent_at=time.monotonic())
    pieces: list[str] = []
    try:
        async with asyncio.timeout(timeout_s):
            async with session.post(url, json=body) as r:
                if r.status != 200:
                    detail = (await r.content.read(_MAX_ERROR_BYTES)).decode("utf-8", errors="replace")
                    record.error = f"http_{r.status}"
                    log.debug("request failed status=%d body=%s", r.status, detail)
                    return record, ""
                if not body.get("stream"):
                    reply = await r.json()
                    now = time.monotonic()
                    record.ttft_s = record.e2e_s = now - record.sent_at
                    pieces.append(_chunk_text(reply))
                    record.take_usage(reply.get("usage"))
                    record.ok = True
                    return record, "".join(pieces)
                last: float | None = None
                done = False
                async for raw in r.content:
                    line = raw.strip()
                    if not line.startswith(b"data:"):
                        continue
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        done = True
                        break
                    chunk = json.loads(data)
                    if not isinstance(chunk, dict):
                        continue
                    if "error" in chunk:
                        record.error = "stream_error"
                        return record, ""
                    piece = _chunk_text(chunk)
                    if piece:  # a token; role-only and finish-only chunks carry no text
                        now = time.monotonic()
                        if last is None:
                            record.ttft_s = now - record.sent_at
                        else:
                            record.itl_s.append(now - last)
                        last = now
                        record.output_tokens += 1
                        pieces.append(piece)
                    if isinstance(chunk.get("usage"), dict):
                        record.take_usage(chunk["usage"])
                if not done:
                    record.error = "stream_truncated"
                    return record, ""
                record.e2e_s = time.monotonic() - record.sent_at
                record.ok = record.ttft_s is not None
                if not record.ok:
                    record.error = "no_tokens"
    except TimeoutError:
        record.error = "timeout"
    except (aiohttp.ClientError, OSError) as exc:
        record.error = type(exc).__name__
    except ValueError:
        record.error = "bad_response"
    return record, "".join(pieces)
