"""The sim engine's HTTP face: OpenAI completions and chat (streamed or not), health, metrics, prefix probe.

Every request body is untrusted: it is size-capped by aiohttp, must be a JSON
object, and each field is checked before the engine sees it (a bad one is a
400 naming the field). A client that goes away mid-stream has its request
dropped from the batch at once: a stream notices on its next write, and every
request (streamed or not) through aiohttp's handler cancellation, which
``serve`` turns on, so a client that closes its connection frees its slot
however far the request got. Output must fit the context: ``max_tokens``
over ``--max-model-len`` minus the prompt is refused with 400, as vLLM does,
and ``/v1/models`` reports ``max_model_len`` as vLLM's model card does (the
router reads it). ``cache_salt`` (vLLM's extension) salts the request's block
keys: requests with different salts never share a cached block, in the
engine-local cache or the pool. Latency metrics are taken on the served
response: TTFT when the first token's chunk has been written, ITL between
written chunks, e2e at the end.

While draining (SIGTERM) ``/health`` answers 503 and new requests are refused
with 503, while requests already accepted run to completion.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Mapping
from typing import Any

from aiohttp import web

from daybreak.serving import openai
from daybreak.serving.openai import Kind, RequestError
from daybreak.serving.prompt import PromptError, block_keys, parse_prompt
from daybreak.serving.sim.engine import Engine, Usage
from daybreak.serving.sim.metrics import PromMetrics

log = logging.getLogger(__name__)

# What the engine "says": one byte-level token per character, the same for every request.
OUTPUT_TEXT = "The quick brown fox jumps over the lazy dog. "
MAX_BODY_BYTES = 64 << 20  # a 1M-token prompt as JSON token ids fits; bigger is refused by aiohttp
_MAX_PREFIX_KEYS = 1 << 16


def output_text(count: int, *, start: int = 0) -> str:
    """The text of output tokens ``start .. start+count-1``."""
    return "".join(OUTPUT_TEXT[i % len(OUTPUT_TEXT)] for i in range(start, start + count))


def usage_of(usage: Usage) -> dict[str, Any]:
    """The ``usage`` object of a finished request."""
    return openai.usage_dict(prompt_tokens=usage.prompt_tokens, completion_tokens=usage.completion_tokens,
                             cached_tokens=usage.cached_tokens, daybreak={
                                 "pool_hit_tokens": usage.pool_hit_tokens,
                                 "local_hit_tokens": usage.local_hit_tokens,
                                 "computed_tokens": usage.computed_tokens,
                                 "bytes_read": usage.bytes_read, "bytes_written": usage.bytes_written,
                                 "blocks_checked": usage.blocks_checked, "blocks_corrupt": usage.blocks_corrupt})


def _error(status: int, message: str, *, param: str | None = None) -> web.Response:
    kind = "invalid_request_error" if status < 500 else "service_unavailable"
    return web.json_response(openai.error_body(message, kind=kind, param=param, code=status), status=status)


class SimServer:
    """The aiohttp application around one ``Engine``."""

    def __init__(self, engine: Engine, metrics: PromMetrics, *, model: str, max_model_len: int = 131072) -> None:
        self.engine = engine
        self.metrics = metrics
        self.model = model
        self.max_model_len = max_model_len
        self.ready = False  # set once the pool is reached (or at once without a pool)
        self.draining = False
        self.active = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self.app = web.Application(client_max_size=MAX_BODY_BYTES)
        self.app.add_routes([
            web.post("/v1/completions", self.completions),
            web.post("/v1/chat/completions", self.chat),
            web.post("/daybreak/v1/prefix", self.prefix),
            web.get("/v1/models", self.models),
            web.get("/health", self.health),
            web.get("/metrics", self.metrics_page),
        ])

    async def wait_idle(self) -> None:
        """Until no request is being served."""
        await self._idle.wait()

    # -- endpoints ---------------------------------------------------------------------------------

    async def health(self, _request: web.Request) -> web.Response:
        if self.draining:
            return web.json_response({"status": "draining"}, status=503)
        if not self.ready:
            return web.json_response({"status": "starting"}, status=503)
        return web.json_response({"status": "ok", "role": self.engine.config.role.value})

    async def metrics_page(self, _request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(), headers={"Content-Type": "text/plain; version=0.0.4"})

    async def models(self, _request: web.Request) -> web.Response:
        """vLLM's model list: one model, with the context length clients must fit prompt and output in."""
        return web.json_response({"object": "list", "data": [{
            "id": self.model, "object": "model", "created": 0, "owned_by": "daybreak", "root": self.model,
            "max_model_len": self.max_model_len}]})

    async def prefix(self, request: web.Request) -> web.Response:
        body = await self._json(request)
        if isinstance(body, web.Response):
            return body
        keys = body.get("keys")
        if (not isinstance(keys, list) or len(keys) > _MAX_PREFIX_KEYS
                or not all(isinstance(k, str) and 0 < len(k) <= 128 for k in keys)):
            return _error(400, f"keys must be a list of at most {_MAX_PREFIX_KEYS} hex block keys", param="keys")
        return web.json_response({"local_blocks": self.engine.cache.prefix(keys, touch=False)})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "completion")

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "chat")

    # -- generation --------------------------------------------------------------------------------

    async def _json(self, request: web.Request) -> dict[str, Any] | web.Response:
        try:
            body = await request.json(loads=json.loads)
        except web.HTTPRequestEntityTooLarge:
            return _error(413, f"request body over {MAX_BODY_BYTES} bytes")
        except (ValueError, UnicodeDecodeError):
            return _error(400, "body must be JSON")
        if not isinstance(body, dict):
            return _error(400, "body must be a JSON object")
        return body

    def _parse(self, body: Mapping[str, Any], kind: Kind) -> tuple[list[int], int, bool, bool, str]:
        if kind == "chat" and "messages" not in body and "hash_ids" not in body:
            raise RequestError("messages: required for /v1/chat/completions")
        tokens = parse_prompt(body).tokens
        if not tokens:
            raise RequestError("prompt: must hold at least one token")
        if len(tokens) > self.max_model_len:
            raise RequestError(f"prompt: {len(tokens)} tokens is over this engine's --max-model-len "
                               f"{self.max_model_len}")
        stream, include_usage = openai.stream_settings(body)
        limit = openai.max_tokens(body, context_length=self.max_model_len, prompt_tokens=len(tokens))
        return tokens, limit, stream, include_usage, openai.cache_salt(body) or ""

    async def _generate(self, request: web.Request, kind: Kind) -> web.StreamResponse:
        arrived = time.monotonic()
        if self.draining:
            return _error(503, "engine is draining; send the request to another replica")
        if not self.ready:
            return _error(503, "engine is starting (waiting for the pool)")
        body = await self._json(request)
        if isinstance(body, web.Response):
            return body
        try:
            tokens, max_tokens, stream, include_usage, salt = self._parse(body, kind)
        except (RequestError, PromptError) as exc:
            return _error(400, str(exc), param=str(exc).split(" ", 1)[0].rstrip(":") or None)
        keys = block_keys(tokens, self.engine.config.block_tokens, salt=salt)
        self.active += 1
        self._idle.clear()
        handle = self.engine.submit(tokens, keys, max_tokens=max_tokens)
        rid = openai.request_id(kind)
        created = int(time.time())
        ttft: float | None = None
        itls: list[float] = []
        last = arrived
        finished = False
        response = web.StreamResponse(headers=openai.SSE_HEADERS)
        try:
            if not stream:
                count = 0
                async for _ in handle.tokens():
                    now = time.monotonic()
                    if ttft is None:
                        ttft = now - arrived
                    else:
                        itls.append(now - last)
                    last = now
                    count += 1
                finished = True
                return web.json_response(openai.response_body(
                    kind=kind, rid=rid, model=self.model, text=output_text(count), finish_reason="length",
                    usage=usage_of(handle.usage), created=created))
            await response.prepare(request)
            first = True
            async for index in handle.tokens():
                await response.write(openai.sse(openai.chunk_body(
                    kind=kind, rid=rid, model=self.model, text=output_text(1, start=index), first=first,
                    created=created)))
                first = False
                now = time.monotonic()
                if ttft is None:
                    ttft = now - arrived
                else:
                    itls.append(now - last)
                last = now
            await response.write(openai.sse(openai.chunk_body(
                kind=kind, rid=rid, model=self.model, text=None, finish_reason="length", first=first,
                created=created)))
            if include_usage:
                await response.write(openai.sse(openai.usage_chunk(
                    kind=kind, rid=rid, model=self.model, usage=usage_of(handle.usage), created=created)))
            await response.write(openai.DONE)
            await response.write_eof()
            finished = True
            return response
        except ConnectionResetError:
            # The client went away (aiohttp's ClientConnectionResetError): nothing left to answer.
            log.info("event=client_gone request=%s", rid)
            return response
        except asyncio.CancelledError:
            log.info("event=client_gone request=%s", rid)
            raise
        finally:
            if finished:
                self.metrics.served(ttft=ttft, itls=itls, e2e=time.monotonic() - arrived)
            else:
                handle.abort()
            self.active -= 1
            if not self.active:
                self._idle.set()


__all__ = ["OUTPUT_TEXT", "SimServer", "output_text", "usage_of"]
