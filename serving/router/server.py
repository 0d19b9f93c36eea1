"""The router's HTTP face: OpenAI-compatible endpoints that run each request as prefill, then decode.

Per request (``/v1/completions`` or ``/v1/chat/completions``):

1. parse the prompt (``serving.prompt``) and compute its chained block keys
   (only when a kvLayout is configured; a vLLM deployment may run without);
2. ask the pool how many leading blocks it holds (``pool_lookup``:
   ``batch_exists``, one round trip per 1,024 keys, stopping at the first miss);
3. unless the pool holds every full block, run a **prefill step** on the pod
   ``choice.rank`` picks by load and engine-local prefix (``max_tokens: 1``,
   ``stream: false``); the engine writes the blocks it computed to the pool;
4. run the **decode step** with the original request on the decode pod the
   same estimate picks (load, and the loads its engine-local prefix saves),
   relaying its stream, and report one ``usage`` summed over both.

A step that fails or is refused (connection error, 429, 5xx) is retried on
another pod while the request's deadline allows. A decode stream that breaks
after tokens were relayed is resumed on another pod, dropping as many chunks as
the client already has: that is exact for deterministic decoding (the sim
engine, greedy or seeded sampling) and is the documented limit otherwise.
A 4xx from an engine is the request's fault and is relayed as is.

Without prefill pods configured (``colocated``), each request is one step on a
``both``-role engine chosen like a prefill pod. The router holds no index: a
restarted one routes as well as before, because the pool and the pods answer
every question again.

Bounded, so that no client starves the others (docs/security.md):

- **Admission**: with ``--auth-dir`` a request needs a known bearer token
  (401 otherwise); each client (its credential, else its address) has at most
  ``--max-concurrent-per-client`` requests in flight (429 beyond).
- **Cancellation**: a client that goes away cancels its handler (aiohttp's
  handler cancellation, turned on in ``serve``), and with it the upstream
  requests to prefill and decode, whose connections are closed, so the
  engines drop the sequences and free their slots.
- **Deadline and output cap**: every request ends within
  ``--request-timeout-seconds``; ``max_tokens`` over the model's context
  length minus the prompt is refused with 400 (the context length from
  ``--max-model-len`` or the engines' ``/v1/models``).
- **Hold while engines start** (scale from zero): a request that finds no
  ready engine of a role (decode, or prefill where configured) waits in a
  bounded queue (``--hold-queue``, ``--hold-seconds``) instead of failing;
  the gauge ``daybreak_router_held_requests`` (by ``role``) counts them, and
  the planner starts a role at zero on it. It is released as soon as every
  role has a ready pod (its wait counts in its TTFT, measured from arrival);
  a full queue, or a hold past its deadline with no decode pod, is answered
  503 with ``Retry-After``; a client that goes away frees its slot. Past the
  deadline with decode ready but prefill still missing, decode computes the
  prompt (slower, not failed). ``--hold-queue 0`` turns holding off: then
  the gauge is not exported and the planner keeps a pod per role.
- **Prefill room** (``--prefill-concurrency N``): at most N prefill steps
  in flight on one prefill pod; a request that finds none with room waits
  in the same queue (first come, first served, counted in the gauge under
  ``role="prefill"``) and goes to the first pod with room, one that just
  started included, instead of the least-loaded pod's own queue at arrival.
  It never fails for room: past ``--hold-seconds`` or with the queue full
  it is bound at once as without the bound. With ``--ttft-target S`` the
  requests that can still have their first token within S of arriving
  (their wait plus their own prompt's prefill, ``line.py``) go first, and
  those that cannot (they miss it wherever they wait) after.
- **Prefill on decode while prefill has no room** (``--decode-prefill K``,
  with ``--prefill-concurrency``): a request that would wait for prefill
  room goes straight to decode instead while fewer than K such prompts per
  ready decode pod are in flight; decode computes the prompt in its own
  batch (chunked prefill, as vLLM does), slower per step for the sequences
  decoding beside it but not queued behind a burst. Dynamo calls this
  conditional disaggregation. The planner counts these requests as
  prefill's backlog (gauge ``daybreak_router_decode_prefill_requests``):
  they are prefill's demand, served elsewhere while prefill is short.
- **No cache oracle**: ``cached_tokens`` and the ``daybreak`` usage counters
  reach clients only with ``--cache-statistics``; pod addresses and the
  prefill outcome appear in response headers only with ``--debug-headers``;
  under auth each credential's requests carry their own ``cache_salt``
  (``auth.credential_salt``), so tenants never share cached blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import signal
import time
import uuid
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import aiohttp
from aiohttp import web
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from daybreak.api.metrics import ROUTER_DECODE_PREFILL_REQUESTS as DECODE_PREFILL_REQUESTS
from daybreak.api.metrics import ROUTER_HELD_REQUESTS as HELD_REQUESTS
from daybreak.errors import DaybreakError
from daybreak.serving import openai
from daybreak.serving.prompt import PromptError, block_keys, parse_prompt
from daybreak.serving.router import choice
from daybreak.serving.router.auth import Credentials, credential_salt
from daybreak.serving.router.discovery import PodState, RolePods
from daybreak.serving.router.limits import DEFAULT_MAX_CONCURRENT_PER_CLIENT, ConcurrencyLimits, client_id
from daybreak.serving.router.line import PrefillTime, Waiting, next_in_line
from daybreak.serving.router.pool_lookup import PoolLookup

log = logging.getLogger(__name__)

RETRYABLE_STATUS = frozenset({408, 429, 500, 502, 503, 504})
MAX_BODY_BYTES = 32 << 20
MAX_RESPONSE_BYTES = 64 << 20
# A retry whose every known pod already failed waits this long for discovery to list another one.
RETRY_WAIT_SECONDS = 5.0
# A prefix query that takes longer than this is not worth its answer: route on load alone.
PREFIX_TIMEOUT = 0.5
# What a client is told to wait before retrying when the hold queue is full or the engines' start ran past
# --hold-seconds: about a sim/vLLM pod's start-up, so the retry finds them more likely up than not.
HOLD_RETRY_AFTER_SECONDS = 10
# How often a held request looks whether every role has a ready pod (discovery re-reads about every second).
HOLD_POLL_SECONDS = 0.1
DEFAULT_HOLD_QUEUE = 64
DEFAULT_HOLD_SECONDS = 120.0
# How long a context length learnt from the engines' /v1/models is trusted (a rollout may change the model).
CONTEXT_LENGTH_TTL_SECONDS = 30.0
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


@dataclass(frozen=True)
class RouterConfig:
    """Everything that changes how requests are routed (one object, printed at start-up)."""

    block_tokens: int | None = None
    """Tokens per KV block (from --kv-layout); None: no block keys, route on load alone."""
    deadline_seconds: float = 60.0
    """A failed step is retried on another pod only this long after the request arrived."""
    max_attempts: int = 3
    """Tries per step, the first included."""
    connect_timeout_seconds: float = 2.0
    """Connecting to an engine pod."""
    idle_timeout_seconds: float = 60.0
    """An engine that sends nothing for this long has failed the step."""
    cost: choice.CostModel = field(default_factory=choice.CostModel)
    """The choice's cost estimate."""
    request_timeout_seconds: float = 600.0
    """Every request ends this long after it arrived, streamed or not (504, or an error event mid-stream):
    a stream nobody reads cannot hold a decode slot for longer."""
    max_concurrent_per_client: int = DEFAULT_MAX_CONCURRENT_PER_CLIENT
    """Requests in flight per client (credential, else address); more are answered 429. 0: unbounded."""
    max_model_len: int | None = None
    """The model's context length in tokens (prompt plus output); None: learnt from the engines' /v1/models."""
    cache_statistics: bool = False
    """Pass ``usage.prompt_tokens_details`` and ``usage.daybreak`` to clients (they tell what a cache held)."""
    debug_headers: bool = False
    """Say in response headers which pods served a request, whether prefill ran, and the kvNamespace."""
    hold_queue: int = DEFAULT_HOLD_QUEUE
    """Requests held at once while a role has no ready engine (scale from zero); more are answered 503 with
    ``Retry-After``. 0: no holding (503 after the short discovery wait), and no held-requests gauge, so the
    planner never takes a role to zero."""
    hold_seconds: float = DEFAULT_HOLD_SECONDS
    """A held request waits at most this long from its arrival for the engines (a pod's start-up, with margin);
    then 503 with ``Retry-After`` (or, with decode ready and prefill still missing, decode computes)."""
    prefill_concurrency: int = 0
    """Prefill steps in flight at once on one prefill pod; more wait in the hold queue for the first pod with
    room (``Router._prefill_room``). 0: no bound (a request is bound to a pod when it arrives)."""
    decode_prefill: int = 0
    """With ``prefill_concurrency``: prompts per ready decode pod that decode may compute itself, in flight at
    once, instead of waiting for prefill room. 0: never (a request always waits for prefill)."""
    ttft_target_seconds: float | None = None
    """With ``prefill_concurrency``: requests held for prefill room that can still have their first token
    within this long of arriving go before those that cannot (``Router._next_in_line``). None: first come,
    first served."""


class Metrics:
    """The router's Prometheus metrics, in its own registry."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("daybreak_router_requests", "Requests received", ["endpoint"], registry=r)
        self.failures = Counter("daybreak_router_request_failures", "Requests that failed, by reason",
                                ["reason"], registry=r)
        self.retries = Counter("daybreak_router_retries", "Steps retried on another pod", ["role"], registry=r)
        self.step_seconds = Histogram("daybreak_router_step_seconds", "Duration of a successful step, per role",
                                      ["role"], buckets=_LATENCY_BUCKETS, registry=r)
        self.ttft_seconds = Histogram("daybreak_router_time_to_first_token_seconds",
                                      "Request arrival to the first token relayed (streams)", buckets=_LATENCY_BUCKETS,
                                      registry=r)
        self.request_seconds = Histogram("daybreak_router_request_seconds", "Request arrival to its last byte",
                                         buckets=_LATENCY_BUCKETS, registry=r)
        self.prefill_skipped = Counter("daybreak_router_prefill_skipped", "Prefill steps not run, by reason",
                                       ["reason"], registry=r)
        self.prompt_blocks = Counter("daybreak_router_prompt_blocks", "Full prompt blocks seen, and those the "
                                     "pool held at routing time", ["source"], registry=r)
        self.pool_lookup_seconds = Histogram("daybreak_router_pool_lookup_seconds", "Pool prefix lookups",
                                             buckets=_LATENCY_BUCKETS, registry=r)
        self.drained_requests = Counter("daybreak_router_drained_requests", "Requests that arrived while the "
                                        "router was draining (served, then the connection closed)", registry=r)
        self.in_flight = Gauge("daybreak_router_requests_in_flight", "Requests being served", registry=r)
        self.ready_pods = Gauge("daybreak_router_ready_pods", "Ready pods per role", ["role"], registry=r)
        self.hold_seconds = Histogram("daybreak_router_hold_seconds", "Time a request was held for engines to "
                                      "start or for prefill room (released or not)", buckets=_LATENCY_BUCKETS, registry=r)
        self.decode_prefill = Gauge(DECODE_PREFILL_REQUESTS, "Requests whose prompt decode computes because no "
                                    "prefill pod had room (--decode-prefill), in flight", registry=r)
        self.held: Gauge | None = None
        """``HELD_REQUESTS`` by role: only where the router holds requests (the planner reads its absence as
        'nothing could start a role again from zero')."""

    def export_held(self, roles: list[str]) -> Gauge:
        """Create the held-requests gauge with a zero sample per role: a gauge without samples reads to the
        planner as no gauge at all."""
        self.held = Gauge(HELD_REQUESTS, "Requests held because no engine of a role is ready (scale from zero) "
                          "or no prefill pod has room (--prefill-concurrency)",
                          ["role"], registry=self.registry)
        for role in roles:
            self.held.labels(role).set(0)
        return self.held


class Room(Enum):
    """Where a request's prompt goes under ``--prefill-concurrency`` (``Router._prefill_room``)."""

    UNBOUNDED = "unbounded"  # no bound applies (none configured, queue full, past the hold): bound at once
    SLOT = "slot"  # a prefill pod's slot was taken for it
    DECODE = "decode"  # decode computes it (``--decode-prefill``)


class StepFailed(DaybreakError):
    """A step found no pod that served it within the attempts and the deadline."""

    def __init__(self, role: str, reason: str) -> None:
        self.role = role
        self.reason = reason
        super().__init__(f"{role} step failed: {reason}")


class Refused(DaybreakError):
    """An engine answered 4xx: the request's fault, relayed to the client as is."""

    def __init__(self, status: int, body: bytes, content_type: str) -> None:
        self.status = status
        self.body = body
        self.content_type = content_type
        super().__init__(f"engine refused the request with {status}")


class ClientGone(DaybreakError):
    """The client closed its connection mid-stream."""


def _error(status: int, message: str, *, kind: str = "invalid_request_error", param: str | None = None
           ) -> web.Response:
    return web.json_response(openai.error_body(message, kind=kind, param=param, code=None), status=status)


def combine_usage(prefill: Mapping[str, Any] | None, decode: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """One ``usage`` for the client: the decode step's counts, ``daybreak.*`` summed over both steps.

    ``cached_tokens = prompt_tokens - computed``, where ``computed`` is the longer of the two steps'
    computed suffixes (the tokens either step computed; decode's recomputed tail lies inside prefill's),
    so a token either step had to compute is never reported as cached, and none is counted twice. Engines
    without the ``daybreak`` extension (vLLM) pass their own ``cached_tokens`` through.
    """
    if decode is None:
        return None
    out = dict(decode)
    steps = [u for u in (prefill, decode) if u]
    extensions: list[Mapping[str, Any]] = [u["daybreak"] for u in steps if isinstance(u.get("daybreak"), Mapping)]
    if not extensions:
        return out
    summed: dict[str, int] = {name: sum(int(e.get(name) or 0) for e in extensions)
                              for name in openai.DAYBREAK_USAGE_FIELDS}
    out["daybreak"] = summed
    prompt_tokens = int(decode.get("prompt_tokens") or 0)
    details = dict(decode.get("prompt_tokens_details") or {})
    # Each step computes a suffix of the prompt (what its cache did not hold), so the tokens either step
    # computed are the longer suffix: decode's recomputed partial tail block is inside prefill's.
    computed = max(int(e.get("computed_tokens") or 0) for e in extensions)
    details["cached_tokens"] = max(prompt_tokens - computed, 0)
    out["prompt_tokens_details"] = details
    return out


@dataclass
class _Stream:
    """Relay state of one streamed decode: what the client already has."""

    response: web.StreamResponse | None = None
    sent_chunks: int = 0
    usage: dict[str, Any] | None = None
    template: dict[str, Any] | None = None


class Router:
    """The aiohttp application and the request path; one per process."""

    def __init__(self, *, config: RouterConfig, decode: RolePods, prefill: RolePods | None = None,
                 pool: PoolLookup | None = None, kv_namespace: str | None = None,
                 auth: Credentials | None = None) -> None:
        self.config = config
        self.auth = auth
        """Bearer-token credentials (``--auth-dir``); None: every client is admitted, known by its address."""
        self.limits = ConcurrencyLimits(per_client=config.max_concurrent_per_client)
        self._context_length: tuple[float, int | None] = (0.0, None)  # (learnt at, value)
        self._context_lock = asyncio.Lock()
        self.kv_namespace = kv_namespace
        """``--kv-namespace``: the namespace of pods without the label (static endpoints)."""
        self.prefill = prefill
        self.decode = decode
        self.pool = pool
        self.metrics = Metrics()
        self.draining = False
        self._last_request = time.monotonic()
        self.drained_requests = 0
        """Requests that arrived while draining (served; their connections closed after the response)."""
        self._session: aiohttp.ClientSession | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._prefix_api: dict[str, bool] = {}  # pod -> whether it serves /daybreak/v1/prefix (capability)
        self._in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self.held = 0
        """Requests held right now for lack of a ready engine or of prefill room (at most ``config.hold_queue``)."""
        self._room_queue: deque[Waiting] = deque()  # requests waiting for prefill room, in arrival order
        self._admitting = 0  # requests let through to a prefill slot that have not begun their step yet
        self._prefill_time = PrefillTime()  # seconds per prefill token, from the steps timed (``line``)
        self._decode_prefilling = 0  # requests sent to decode without prefill for lack of prefill room, in flight
        if config.hold_queue > 0:
            self.metrics.export_held(["engine"] if prefill is None else ["prefill", "decode"])

    @property
    def colocated(self) -> bool:
        return self.prefill is None

    # -- application ------------------------------------------------------------------------------

    def app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY_BYTES)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        app.on_response_prepare.append(self._close_when_draining)
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)
        return app

    async def _start(self, _app: web.Application) -> None:
        connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=None)
        self._session = aiohttp.ClientSession(connector=connector, auto_decompress=False)
        for pods in (self.prefill, self.decode):
            if pods is not None:
                self._tasks.append(asyncio.create_task(pods.run(self._session), name=f"pods-{pods.role}"))
        if self.auth is not None:
            self._tasks.append(asyncio.create_task(self.auth.run(), name="credentials"))

    async def _stop(self, _app: web.Application) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self.pool is not None:
            await self.pool.close()
        if self._session is not None:
            await self._session.close()

    async def drain(self, *, timeout_seconds: float, quiet_seconds: float = 0.0) -> None:
        """Stop looking ready, keep serving, and return once nothing is in flight and no request came for
        ``quiet_seconds`` (bounded by ``timeout_seconds``).

        A request that reaches a draining router was sent by a client (or a Service) that does not know
        yet: refusing it would fail it, so it is served, on a connection closed after the response
        (``Connection: close``), and the client's next connection goes to a ready router. The quiet time
        covers the endpoint update reaching every proxy and the clients' idle keep-alive connections
        timing out on their side: closing one of those from here could race a request the client is
        sending on it, which HTTP/1.1 does not let a client retry safely (POST is not idempotent).
        """
        self.draining = True
        self._last_request = time.monotonic()
        deadline = time.monotonic() + timeout_seconds
        while time.monotonic() < deadline:
            left = deadline - time.monotonic()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._idle.wait(), left)
            quiet = time.monotonic() - self._last_request
            if self._idle.is_set() and quiet >= quiet_seconds:
                return
            await asyncio.sleep(min(max(quiet_seconds - quiet, 0.05), max(deadline - time.monotonic(), 0.0)))

    async def _close_when_draining(self, _request: web.Request, response: web.StreamResponse) -> None:
        # Runs after aiohttp chose the headers, before it writes them: say it and close after the response.
        if self.draining:
            response.force_close()
            response.headers["Connection"] = "close"

    # -- small endpoints ---------------------------------------------------------------------------

    async def _health(self, _request: web.Request) -> web.Response:
        decode = len(self.decode.pods())
        prefill = len(self.prefill.pods()) if self.prefill else None
        body = {"status": "ok", "decode_pods": decode, "prefill_pods": prefill, "draining": self.draining}
        if self.draining:
            body["status"] = "draining"
            return web.json_response(body, status=503)
        body["held_requests"] = self.held
        if decode == 0:
            status = "no ready decode pods" if not self.colocated else "no ready engine pods"
            if self.config.hold_queue > 0:
                # Ready all the same: at zero the router must take requests (and hold them) so that the planner
                # sees them and starts the engines; an unready router would get none and never wake them.
                body["status"] = status + ", holding requests"
                return web.json_response(body)
            body["status"] = status
            return web.json_response(body, status=503)
        return web.json_response(body)

    async def _metrics(self, _request: web.Request) -> web.Response:
        self.metrics.ready_pods.labels("decode" if not self.colocated else "engine").set(len(self.decode.pods()))
        if self.prefill is not None:
            self.metrics.ready_pods.labels("prefill").set(len(self.prefill.pods()))
        return web.Response(body=generate_latest(self.metrics.registry),
                            headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _models(self, request: web.Request) -> web.Response:
        assert self._session is not None
        if self.auth is not None and self.auth.identify(request.headers.get("Authorization")) is None:
            return self._unauthorized()
        for pod in self.decode.pods():
            try:
                async with self._session.get(f"http://{pod.address}/v1/models",
                                             timeout=aiohttp.ClientTimeout(total=5)) as r:
                    if r.status == 200:
                        return web.Response(body=await r.read(), content_type="application/json")
            except (aiohttp.ClientError, TimeoutError, OSError):
                continue
        return _error(503, "no engine pod answered /v1/models", kind="service_unavailable")

    # -- the request path --------------------------------------------------------------------------

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, "/v1/completions")

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, "/v1/chat/completions")

    def _unauthorized(self) -> web.Response:
        self.metrics.failures.labels("unauthorized").inc()
        response = _error(401, "a valid bearer token is required: send 'Authorization: Bearer <token>' with a "
                          "token from the Secret named by the PDDeployment's spec.router.auth.secretName",
                          kind="authentication_error")
        response.headers["WWW-Authenticate"] = 'Bearer realm="daybreak-router"'
        return response

    async def _serve(self, request: web.Request, path: str) -> web.StreamResponse:
        started = time.monotonic()
        self.metrics.requests.labels(path).inc()
        self._last_request = started
        if self.draining:
            self.drained_requests += 1
            self.metrics.drained_requests.inc()
        credential: str | None = None
        if self.auth is not None:
            credential = self.auth.identify(request.headers.get("Authorization"))
            if credential is None:
                return self._unauthorized()
        client = client_id(credential=credential, peer=request.remote)
        if not self.limits.try_acquire(client):
            self.metrics.failures.labels("client_concurrency_limit").inc()
            response = _error(429, f"this client already has {self.limits.in_flight(client)} requests in flight, "
                              f"the most one client may have (--max-concurrent-per-client); retry when one ends",
                              kind="rate_limit_error")
            response.headers["Retry-After"] = "1"
            return response
        self._in_flight += 1
        self._idle.clear()
        self.metrics.in_flight.inc()
        state = _Stream()
        try:
            async with asyncio.timeout(self.config.request_timeout_seconds):
                return await self._route(request, path, started, state=state, credential=credential)
        except TimeoutError:
            # The deadline cancelled the steps (their upstream connections closed, the engines freed the
            # slots); a stream already under way ends with an error event, anything else is a 504.
            self.metrics.failures.labels("request_timeout").inc()
            message = f"request exceeded the router's deadline of {self.config.request_timeout_seconds:g} s"
            log.warning("event=request_timeout path=%s timeout_s=%g", path, self.config.request_timeout_seconds)
            if state.response is None:
                return _error(504, message, kind="timeout")
            with contextlib.suppress(ConnectionError, RuntimeError):
                await state.response.write(openai.sse(openai.stream_error_body(message, kind="timeout")))
                await state.response.write_eof()
            return state.response
        except asyncio.CancelledError:
            # The client went away (handler cancellation): the steps' upstream requests were cancelled with us.
            self.metrics.failures.labels("client_gone").inc()
            raise
        finally:
            self.limits.release(client)
            self._in_flight -= 1
            self.metrics.in_flight.dec()
            self.metrics.request_seconds.observe(time.monotonic() - started)
            if self._in_flight == 0:
                self._idle.set()

    async def context_length(self) -> int | None:
        """The model's context length: ``--max-model-len``, else what a decode pod's ``/v1/models`` says
        (vLLM's ``max_model_len``), re-learnt every 30 s; None when no engine says (the engine checks)."""
        if self.config.max_model_len:
            return self.config.max_model_len
        learnt_at, value = self._context_length
        if time.monotonic() - learnt_at < CONTEXT_LENGTH_TTL_SECONDS:
            return value
        async with self._context_lock:
            learnt_at, value = self._context_length
            if time.monotonic() - learnt_at < CONTEXT_LENGTH_TTL_SECONDS:
                return value
            value = await self._ask_context_length()
            # An unknown answer is retried sooner: the pods may just be starting.
            self._context_length = (time.monotonic() - (0 if value else CONTEXT_LENGTH_TTL_SECONDS - 2), value)
            return value

    async def _ask_context_length(self) -> int | None:
        assert self._session is not None
        for pod in self.decode.pods():
            try:
                async with self._session.get(f"http://{pod.address}/v1/models",
                                             timeout=aiohttp.ClientTimeout(total=2)) as r:
                    if r.status != 200:
                        continue
                    models = (await r.json()).get("data") or []
                    lengths = [m.get("max_model_len") for m in models if isinstance(m, dict)]
                    known = [n for n in lengths if isinstance(n, int) and not isinstance(n, bool) and n > 0]
                    if known:
                        return min(known)
            except (aiohttp.ClientError, TimeoutError, OSError, ValueError, AttributeError):
                continue
        return None

    def _public_usage(self, usage: dict[str, Any]) -> dict[str, Any]:
        return usage if self.config.cache_statistics else openai.without_cache_statistics(usage)

    async def _route(self, request: web.Request, path: str, started: float, *, state: _Stream,
                     credential: str | None) -> web.StreamResponse:
        # A client's id is echoed, never trusted for anything: it only ties log lines together.
        given = request.headers.get("x-request-id") or ""
        rid = given if 0 < len(given) <= 64 and given.isprintable() else uuid.uuid4().hex[:16]
        try:
            body = json.loads(await request.read())
        except (ValueError, UnicodeDecodeError):
            self.metrics.failures.labels("bad_request").inc()
            return _error(400, "request body must be a JSON object")
        except web.HTTPRequestEntityTooLarge:
            self.metrics.failures.labels("bad_request").inc()
            return _error(413, f"request body exceeds {MAX_BODY_BYTES} bytes")
        if not isinstance(body, dict):
            self.metrics.failures.labels("bad_request").inc()
            return _error(400, "request body must be a JSON object")
        try:
            prompt = parse_prompt(body)
        except PromptError as exc:
            self.metrics.failures.labels("bad_request").inc()
            return _error(400, str(exc), param="prompt")
        stream = body.get("stream") is True
        refused = await self._hold(rid=rid, started=started)
        if refused is not None:
            return refused
        try:
            client_salt = openai.cache_salt(body)
            openai.max_tokens(body, context_length=await self.context_length(), prompt_tokens=len(prompt.tokens))
        except openai.RequestError as exc:
            self.metrics.failures.labels("bad_request").inc()
            return _error(400, str(exc), param=str(exc).split(" ", 1)[0].rstrip(":"))
        salt = credential_salt(credential, client_salt) if credential is not None else client_salt
        if salt is not None:
            body["cache_salt"] = salt  # both steps: prefill writes and decode reads the same salted keys
        keys: list[str] = []
        if self.config.block_tokens:
            keys = await asyncio.to_thread(block_keys, prompt.tokens, self.config.block_tokens, salt=salt or "")
        kv_namespace = self._request_namespace()
        pool_blocks: int | None = None
        if self.pool is not None:
            t = time.monotonic()
            # Shielded: a lookup cancelled half-way (its client went away) would leave a pool connection
            # mid-reply; it finishes on its own, bounded by its client's timeout.
            pool_blocks = await asyncio.shield(self.pool.prefix(keys, namespace=kv_namespace))
            self.metrics.pool_lookup_seconds.observe(time.monotonic() - t)
        self.metrics.prompt_blocks.labels("all").inc(len(keys))
        self.metrics.prompt_blocks.labels("pool").inc(pool_blocks or 0)

        # What prefill is expected to compute: the prompt less the pool's prefix (the line's order, its step time).
        uncached = max(len(prompt.tokens) - (pool_blocks or 0) * (self.config.block_tokens or 0), 0)
        headers: dict[str, str] = {"x-request-id": rid}
        route: dict[str, str] = {}  # what ran where, for the logic below; in headers only with --debug-headers
        if kv_namespace:
            route["x-daybreak-kv-namespace"] = kv_namespace
        prefill_usage: dict[str, Any] | None = None
        decode_prefill = False  # decode computes the prompt for lack of prefill room: released when decode ends
        try:
            if self.prefill is not None:
                if choice.skip_prefill(blocks=len(keys), pool_blocks=pool_blocks or 0,
                                       pool_known=pool_blocks is not None):
                    self.metrics.prefill_skipped.labels("pool_holds_prompt").inc()
                    route["x-daybreak-prefill"] = "skipped"
                elif (room := await self._prefill_room(rid=rid, started=started, kv_namespace=kv_namespace,
                                                       tokens=uncached)) is Room.DECODE:
                    decode_prefill = True
                    self.metrics.prefill_skipped.labels("no_prefill_room").inc()
                    route["x-daybreak-prefill"] = "decode"
                else:
                    prefill_body = {k: v for k, v in body.items() if k not in ("stream_options",)}
                    prefill_body.update(max_tokens=1, stream=False)
                    if "max_completion_tokens" in prefill_body:
                        prefill_body["max_completion_tokens"] = 1
                    try:
                        address, reply = await self._json_step(
                            "prefill", self.prefill, path, prefill_body, started=started, keys=keys,
                            pool_blocks=pool_blocks or 0, prefix_aware=True, rid=rid, kv_namespace=kv_namespace,
                            admitted=room is Room.SLOT, tokens=uncached)
                        prefill_usage = reply.get("usage") if isinstance(reply.get("usage"), dict) else None
                        route["x-daybreak-prefill"] = address
                    except StepFailed as exc:
                        # Decode computes what the pool lacks (counted, never skipped): slower, not failed.
                        log.warning("event=prefill_unavailable id=%s reason=%s action=decode_computes", rid,
                                    exc.reason)
                        self.metrics.prefill_skipped.labels("no_prefill_pod").inc()
                        route["x-daybreak-prefill"] = "failed"
            # What decode will find in the pool: everything once prefill wrote it (or it was skipped);
            # otherwise what the lookup saw. Decode's own engine-local prefix saves loads (or compute).
            decode_pool_blocks = pool_blocks or 0
            if self.pool is not None and route.get("x-daybreak-prefill") not in (None, "failed", "decode"):
                decode_pool_blocks = len(keys)
            decode_body = dict(body)
            if self.config.debug_headers:
                headers.update(route)
            if stream:
                raw_options = body.get("stream_options")
                options: dict[str, Any] = raw_options if isinstance(raw_options, dict) else {}
                decode_body["stream_options"] = {**options, "include_usage": True}
                return await self._stream_step(request, path, decode_body, started=started, keys=keys,
                                               pool_blocks=decode_pool_blocks, prefill_usage=prefill_usage,
                                               kv_namespace=kv_namespace, state=state,
                                               headers=headers, rid=rid,
                                               client_wants_usage=bool(options.get("include_usage")))
            address, reply = await self._json_step(
                "decode", self.decode, path, decode_body, started=started, keys=keys,
                pool_blocks=decode_pool_blocks, prefix_aware=True, rid=rid, kv_namespace=kv_namespace)
            if self.config.debug_headers:
                headers["x-daybreak-decode"] = address
            usage = combine_usage(prefill_usage, reply.get("usage") if isinstance(reply.get("usage"), dict)
                                  else None)
            if usage is not None:
                reply["usage"] = self._public_usage(usage)
            return web.json_response(reply, headers=headers)
        except Refused as exc:
            self.metrics.failures.labels("refused").inc()
            return web.Response(status=exc.status, body=exc.body, content_type=exc.content_type or
                                "application/json", headers=headers)
        except StepFailed as exc:
            self.metrics.failures.labels(f"{exc.role}_{exc.reason}").inc()
            log.warning("event=request_failed id=%s role=%s reason=%s", rid, exc.role, exc.reason)
            return _error(503, str(exc), kind="service_unavailable")
        finally:
            if decode_prefill:
                self._decode_prefill_done()

    # -- holding while engines start ---------------------------------------------------------------

    def _missing_role(self) -> str | None:
        """The role a request cannot be served without, when it has no ready pod; None when all have one."""
        if not self.decode.pods():
            return "engine" if self.colocated else "decode"
        if self.prefill is not None and not self.prefill.pods():
            return "prefill"
        return None

    async def _hold(self, *, rid: str, started: float) -> web.Response | None:
        """Wait while a role has no ready pod (scale from zero), in the bounded queue; a 503 to send instead
        of serving, or None to go on. Cancellation (the client went away, the request deadline) frees the slot
        in ``finally``."""
        missing = self._missing_role()
        if missing is None or self.config.hold_queue <= 0 or self.metrics.held is None:
            return None
        gauge = self.metrics.held
        if self.held >= self.config.hold_queue:
            self.metrics.failures.labels("hold_queue_full").inc()
            log.warning("event=hold_refused id=%s reason=queue_full held=%d missing=%s", rid, self.held, missing)
            return self._unavailable(f"no {missing} engine is ready yet and {self.held} requests already wait "
                                     f"for one (--hold-queue {self.config.hold_queue}); retry later")
        self.held += 1
        gauge.labels(missing).inc()
        log.info("event=held id=%s missing=%s held=%d", rid, missing, self.held)
        deadline = started + self.config.hold_seconds
        outcome = "released"
        try:
            while True:
                now_missing = self._missing_role()
                if now_missing is None:
                    return None
                if now_missing != missing:  # decode came up before prefill, say: count it where it waits now
                    gauge.labels(missing).dec()
                    gauge.labels(now_missing).inc()
                    missing = now_missing
                if time.monotonic() >= deadline:
                    if missing == "prefill":
                        outcome = "decode_computes"
                        log.warning("event=hold_expired id=%s missing=prefill action=decode_computes", rid)
                        return None
                    outcome = "expired"
                    self.metrics.failures.labels("hold_expired").inc()
                    log.warning("event=hold_expired id=%s missing=%s hold_s=%g action=503", rid, missing,
                                self.config.hold_seconds)
                    return self._unavailable(f"no {missing} engine became ready within {self.config.hold_seconds:g}"
                                             " s (--hold-seconds): the engines are still starting; retry later")
                await asyncio.sleep(HOLD_POLL_SECONDS)
        except asyncio.CancelledError:
            outcome = "cancelled"
            raise
        finally:
            self.held -= 1
            gauge.labels(missing).dec()
            waited = time.monotonic() - started
            self.metrics.hold_seconds.observe(waited)
            log.info("event=hold_ended id=%s outcome=%s waited_s=%.3f", rid, outcome, waited)

    def _prefill_free(self, kv_namespace: str | None) -> int:
        """Prefill slots free now on the healthy pods of ``kv_namespace`` (on all of them when none is healthy:
        a failed scrape must not stall every request), less those already let through."""
        assert self.prefill is not None
        bound = self.config.prefill_concurrency
        pods = self._pods_of(self.prefill, kv_namespace)
        return sum(max(0, bound - p.in_flight) for p in [p for p in pods if p.healthy] or pods) - self._admitting

    def _decode_prefill_free(self, kv_namespace: str | None) -> bool:
        """Whether decode may compute one more prompt of ``kv_namespace`` itself (``--decode-prefill`` per ready
        decode pod of it, those already sent counted)."""
        if self.config.decode_prefill <= 0:
            return False
        pods = [p for p in self._pods_of(self.decode, kv_namespace) if p.healthy]
        return self._decode_prefilling < self.config.decode_prefill * len(pods)

    async def _prefill_room(self, *, rid: str, started: float, kv_namespace: str | None, tokens: int) -> Room:
        """Wait in line (``_next_in_line``) until a prefill pod has fewer than ``--prefill-concurrency`` steps in
        flight (``Room.SLOT``: ``_admitting`` counts it until the step begins), or, with ``--decode-prefill``,
        until decode may compute the prompt itself (``Room.DECODE``: counted in ``_decode_prefilling``, which
        the caller releases when the decode step ends), whichever comes first.

        Why: a request bound to a pod when it arrives waits in that pod's queue even after a pod just started
        stands idle (the planner's new pods then serve only later arrivals). Held here, it goes to whichever
        pod has room first. It never fails for lack of room: with the hold queue full, past ``--hold-seconds``
        or with no prefill pod left, it goes on as without the bound. Held requests count in
        the held-requests gauge (role prefill): they are demand the engines' own queues no longer show.
        """
        if self.config.prefill_concurrency <= 0 or self.prefill is None or self.metrics.held is None:
            return Room.UNBOUNDED
        if not self._room_queue:
            if self._prefill_free(kv_namespace) > 0:
                self._admitting += 1
                return Room.SLOT
            if self._decode_prefill_free(kv_namespace):
                return self._to_decode()
        if self.held >= self.config.hold_queue:
            return Room.UNBOUNDED
        ticket = Waiting(started, tokens)
        self._room_queue.append(ticket)
        self.held += 1
        gauge = self.metrics.held
        gauge.labels("prefill").inc()
        deadline = started + self.config.hold_seconds
        outcome = "bound_anyway"
        try:
            while time.monotonic() < deadline and self._pods_of(self.prefill, kv_namespace):
                if self._next_in_line(time.monotonic()) is ticket:
                    if self._prefill_free(kv_namespace) > 0:
                        self._admitting += 1
                        outcome = "room"
                        return Room.SLOT
                    if self._decode_prefill_free(kv_namespace):
                        outcome = "decode"
                        return self._to_decode()
                # A prefill step ending wakes it, and so does a prefill-on-decode ending (``_decode_prefill_done``).
                await self.prefill.changed(seconds=HOLD_POLL_SECONDS)
            return Room.UNBOUNDED
        except asyncio.CancelledError:
            outcome = "cancelled"
            raise
        finally:
            self._room_queue.remove(ticket)
            if self._room_queue:
                self.prefill.notify()  # the next in line may take a slot freed with this one (a new pod's)
            self.held -= 1
            gauge.labels("prefill").dec()
            self.metrics.hold_seconds.observe(time.monotonic() - started)
            log.debug("event=room_wait_ended id=%s outcome=%s waited_s=%.3f", rid, outcome,
                      time.monotonic() - started)

    def _next_in_line(self, now: float) -> Waiting:
        """Who takes the next prefill room: the first in line, or with ``ttft_target_seconds`` the first in
        line that can still have its first token within the target (its wait so far plus its own prefill at
        the recent steps' seconds per token, ``line.next_in_line``), and the first in line only when none can.

        Why: in a burst the pods are short for a while and the line grows; first come, first served then
        spends every slot on requests that have already waited past the target and miss it wherever they
        wait, and so makes the next ones late too. Served first, the requests that can still make it do;
        the late ones wait longer (their TTFT grows, never past ``--hold-seconds``, after which they are
        bound to a pod as without the bound) and are not failed. The line keeps arrival order within each
        kind, and the choice is remade at every free slot (a request turns late while it waits)."""
        return next_in_line(self._room_queue, now=now, target=self.config.ttft_target_seconds,
                            prefill=self._prefill_time)

    def _to_decode(self) -> Room:
        self._decode_prefilling += 1
        self.metrics.decode_prefill.set(self._decode_prefilling)
        return Room.DECODE

    def _decode_prefill_done(self) -> None:
        self._decode_prefilling -= 1
        self.metrics.decode_prefill.set(self._decode_prefilling)
        if self._room_queue and self.prefill is not None:
            self.prefill.notify()  # the first in line may now go to decode

    def _unavailable(self, message: str) -> web.Response:
        response = _error(503, message, kind="service_unavailable")
        response.headers["Retry-After"] = str(HOLD_RETRY_AFTER_SECONDS)
        return response

    # -- steps -------------------------------------------------------------------------------------

    def _timeout(self) -> aiohttp.ClientTimeout:
        return aiohttp.ClientTimeout(total=None, connect=self.config.connect_timeout_seconds,
                                     sock_read=self.config.idle_timeout_seconds)

    def _retry_allowed(self, *, attempt: int, started: float) -> bool:
        return (attempt < self.config.max_attempts
                and time.monotonic() - started < self.config.deadline_seconds)

    def _request_namespace(self) -> str | None:
        """The request's kvNamespace, from the pods' labels (see ``choice.request_namespace``)."""
        order = list(range(len(self.decode.pods())))
        random.shuffle(order)
        decode = [p.candidate() for p in self.decode.pods()]
        prefill = [p.candidate() for p in self.prefill.pods()] if self.prefill is not None else None
        return choice.request_namespace(decode, prefill=prefill, default=self.kv_namespace,
                                        tiebreak={c.address: order[i] for i, c in enumerate(decode)})

    def _pods_of(self, pods: RolePods, kv_namespace: str | None) -> list[PodState]:
        if kv_namespace is None:
            return pods.pods()
        return [p for p in pods.pods() if p.kv_namespace in (None, kv_namespace)]

    async def _choose(self, pods: RolePods, tried: set[str], *, started: float, keys: list[str],
                      pool_blocks: int, prefix_aware: bool, kv_namespace: str | None = None,
                      widen: bool = False, room: int = 0) -> str | None:
        """The pod for the next attempt, from pods of ``kv_namespace`` (prefill and decode of one request
        must share the pool's namespace). ``widen`` (decode): when every such pod has been tried or none
        is left, take a pod of another namespace; it computes what its namespace's pool lacks, slower
        but served, where a strict choice would fail the request. ``room`` (prefill, with
        ``--prefill-concurrency``): prefer pods with fewer steps than that in flight."""
        # No pod now (a rollout, a scale from zero): wait a little, within the deadline.
        wait_until = min(started + self.config.deadline_seconds, time.monotonic() + 5.0)
        states = self._pods_of(pods, kv_namespace)
        while not states and not (widen and pods.pods()) and time.monotonic() < wait_until:
            await asyncio.sleep(0.1)
            states = self._pods_of(pods, kv_namespace)
        everyone = pods.pods() if widen else states
        if not everyone:
            return None
        if tried and all(p.address in tried for p in everyone):
            # Every pod known has failed this request. In a rollout that is the old pod, draining, while
            # discovery has not listed its replacement yet: wait a little for one, rather than spend the
            # remaining attempts on the pod that just refused.
            wait_until = min(started + self.config.deadline_seconds, time.monotonic() + RETRY_WAIT_SECONDS)
            while time.monotonic() < wait_until:
                await asyncio.sleep(0.1)
                states = self._pods_of(pods, kv_namespace)
                everyone = pods.pods() if widen else states
                if any(p.address not in tried for p in everyone):
                    break
            if not everyone:
                return None
        fresh = ([p for p in states if p.address not in tried] or [p for p in everyone if p.address not in tried]
                 or states or everyone)
        if room > 0:
            fresh = [p for p in fresh if p.in_flight < room] or fresh
        local: dict[str, int] = {}
        if prefix_aware and keys and len(fresh) > 1:
            local = await self._local_prefixes([p.address for p in fresh], keys)
        order = list(range(len(fresh)))
        random.shuffle(order)
        tiebreak = {p.address: order[i] for i, p in enumerate(fresh)}
        ranked = choice.rank([p.candidate(local.get(p.address, 0)) for p in fresh], blocks=len(keys),
                             pool_blocks=pool_blocks, prefix_aware=prefix_aware, model=self.config.cost,
                             tiebreak=tiebreak)
        return ranked[0].address

    async def _local_prefixes(self, addresses: list[str], keys: list[str]) -> dict[str, int]:
        assert self._session is not None
        session = self._session
        payload = json.dumps({"keys": keys}).encode()

        async def ask(address: str) -> int:
            if self._prefix_api.get(address) is False:
                return 0
            try:
                async with session.post(f"http://{address}/daybreak/v1/prefix", data=payload,
                                        headers={"Content-Type": "application/json"},
                                        timeout=aiohttp.ClientTimeout(total=PREFIX_TIMEOUT)) as r:
                    if r.status in (404, 405):
                        self._prefix_api[address] = False  # e.g. vLLM: it has no engine-local prefix API
                        return 0
                    if r.status != 200:
                        return 0
                    value = (await r.json()).get("local_blocks")
                    return int(value) if isinstance(value, int) and 0 <= value <= len(keys) else 0
            except (aiohttp.ClientError, TimeoutError, OSError, ValueError, AttributeError):
                return 0

        values = await asyncio.gather(*(ask(a) for a in addresses))
        return dict(zip(addresses, values, strict=True))

    async def _json_step(self, role: str, pods: RolePods, path: str, body: dict[str, Any], *, started: float,
                         keys: list[str], pool_blocks: int, prefix_aware: bool, rid: str,
                         kv_namespace: str | None = None, admitted: bool = False,
                         tokens: int = 0) -> tuple[str, dict[str, Any]]:
        """One step, retried on other pods. ``admitted``: a prefill slot was taken for it (``Room.SLOT``);
        ``tokens``: what a prefill step is expected to compute (timed with it for the line's order)."""
        assert self._session is not None
        tried: set[str] = set()
        attempt = 0
        payload = json.dumps(body).encode()
        while True:
            try:
                address = await self._choose(pods, tried, started=started, keys=keys, pool_blocks=pool_blocks,
                                             prefix_aware=prefix_aware, kv_namespace=kv_namespace,
                                             widen=role == "decode",
                                             room=self.config.prefill_concurrency if role == "prefill" else 0)
                if address is None:
                    raise StepFailed(role, "no_ready_pods")
                tried.add(address)
                attempt += 1
                pods.begin(address)
            finally:
                if admitted:  # the slot let through is now the step's in_flight (or was never used)
                    self._admitting -= 1
                    admitted = False
            failed = True
            t = time.monotonic()
            try:
                async with self._session.post(f"http://{address}{path}", data=payload, timeout=self._timeout(),
                                              headers={"Content-Type": "application/json",
                                                       "x-request-id": rid}) as r:
                    data = await r.content.read(MAX_RESPONSE_BYTES)
                    if r.status == 200:
                        reply = json.loads(data)
                        if not isinstance(reply, dict):
                            raise ValueError("engine reply is not a JSON object")
                        failed = False
                        took = time.monotonic() - t
                        self.metrics.step_seconds.labels(role).observe(took)
                        if role == "prefill":
                            self._prefill_time.observe(took, tokens)
                        return address, reply
                    if r.status not in RETRYABLE_STATUS:
                        failed = False
                        raise Refused(r.status, data, r.content_type)
                    reason = f"status_{r.status}"
            except (aiohttp.ClientError, TimeoutError, OSError, ValueError) as exc:
                reason = type(exc).__name__
            except asyncio.CancelledError:
                failed = False  # the client went away or the deadline passed: not the pod's fault
                raise
            finally:
                pods.end(address, failed=failed)
            if not self._retry_allowed(attempt=attempt, started=started):
                raise StepFailed(role, reason)
            self.metrics.retries.labels(role).inc()
            log.info("event=retry id=%s role=%s pod=%s reason=%s attempt=%d", rid, role, address, reason, attempt)
            await asyncio.sleep(min(0.05 * attempt, 0.5))

    async def _stream_step(self, request: web.Request, path: str, body: dict[str, Any], *, started: float,
                           keys: list[str], pool_blocks: int, prefill_usage: dict[str, Any] | None,
                           headers: dict[str, str], rid: str, client_wants_usage: bool, state: _Stream,
                           kv_namespace: str | None = None) -> web.StreamResponse:
        assert self._session is not None
        role = "decode"
        tried: set[str] = set()
        attempt = 0
        payload = json.dumps(body).encode()
        reason = "no_ready_pods"
        while True:
            address = await self._choose(self.decode, tried, started=started, keys=keys, pool_blocks=pool_blocks,
                                         prefix_aware=True, kv_namespace=kv_namespace, widen=True)
            if address is None:
                break
            tried.add(address)
            attempt += 1
            self.decode.begin(address)
            failed = True
            t = time.monotonic()
            try:
                done = await self._relay(request, address, path, payload, state=state, headers=headers,
                                         started=started, rid=rid)
                if done:
                    failed = False
                    self.metrics.step_seconds.labels(role).observe(time.monotonic() - t)
                    return await self._finish_stream(state, prefill_usage, client_wants_usage)
                reason = "stream_ended_early"
            except Refused:
                failed = False
                raise
            except ClientGone:
                failed = False
                self.metrics.failures.labels("client_gone").inc()
                return state.response or web.Response(status=499)
            except (aiohttp.ClientError, TimeoutError, OSError, ValueError) as exc:
                reason = type(exc).__name__
            except asyncio.CancelledError:
                failed = False  # the client went away or the deadline passed: not the pod's fault
                raise
            finally:
                self.decode.end(address, failed=failed)
            if not self._retry_allowed(attempt=attempt, started=started):
                break
            self.metrics.retries.labels(role).inc()
            log.info("event=retry id=%s role=%s pod=%s reason=%s attempt=%d resume_after_chunks=%d", rid, role,
                     address, reason, attempt, state.sent_chunks)
            await asyncio.sleep(min(0.05 * attempt, 0.5))
        self.metrics.failures.labels(f"{role}_{reason}").inc()
        log.warning("event=request_failed id=%s role=%s reason=%s", rid, role, reason)
        if state.response is None:
            return _error(503, f"{role} step failed: {reason}", kind="service_unavailable")
        # The client already has a 200 and some tokens: end the stream with an error event.
        error = openai.stream_error_body(f"{role} step failed mid-stream: {reason}", kind="service_unavailable")
        with contextlib.suppress(ConnectionError, RuntimeError):
            await state.response.write(openai.sse(error, compact=False))
            await state.response.write_eof()
        return state.response

    async def _relay(self, request: web.Request, address: str, path: str, payload: bytes, *, state: _Stream,
                     headers: dict[str, str], started: float, rid: str) -> bool:
        """Relay one decode attempt's stream; True when it reached ``[DONE]``."""
        assert self._session is not None
        async with self._session.post(f"http://{address}{path}", data=payload, timeout=self._timeout(),
                                      headers={"Content-Type": "application/json", "x-request-id": rid}) as r:
            if r.status != 200:
                data = await r.content.read(MAX_RESPONSE_BYTES)
                if r.status in RETRYABLE_STATUS:
                    raise aiohttp.ClientResponseError(r.request_info, (), status=r.status)
                if state.response is None:
                    raise Refused(r.status, data, r.content_type)
                raise aiohttp.ClientResponseError(r.request_info, (), status=r.status)
            seen = 0  # content chunks of this attempt
            event: list[bytes] = []
            async for raw in r.content:
                line = raw.rstrip(b"\r\n")
                if line:
                    event.append(line)
                    continue
                data = b"\n".join(x[5:].lstrip() for x in event if x.startswith(b"data:"))
                event = []
                if not data:
                    continue
                if data == b"[DONE]":
                    return True
                chunk = json.loads(data)
                if not isinstance(chunk, dict):
                    raise ValueError("stream chunk is not a JSON object")
                if "error" in chunk and not chunk.get("choices"):
                    raise ValueError(f"engine sent an error event: {chunk['error']!r}")
                if not chunk.get("choices"):
                    if isinstance(chunk.get("usage"), dict):
                        state.usage = chunk["usage"]
                        state.template = chunk
                    continue
                seen += 1
                if seen <= state.sent_chunks:
                    continue  # the client has this one from an earlier attempt
                if state.response is None:
                    if self.config.debug_headers:
                        headers["x-daybreak-decode"] = address
                    state.response = web.StreamResponse(status=200, headers={**headers, **openai.SSE_HEADERS})
                    try:
                        await state.response.prepare(request)
                    except (ConnectionError, RuntimeError) as exc:
                        raise ClientGone() from exc
                    self.metrics.ttft_seconds.observe(time.monotonic() - started)
                try:
                    await state.response.write(openai.sse_data(data))
                except (ConnectionError, RuntimeError) as exc:
                    raise ClientGone() from exc
                state.sent_chunks += 1
            return False

    async def _finish_stream(self, state: _Stream, prefill_usage: dict[str, Any] | None,
                             client_wants_usage: bool) -> web.StreamResponse:
        response = state.response
        if response is None:
            raise ValueError("decode stream ended without a token")
        if client_wants_usage:
            usage = combine_usage(prefill_usage, state.usage)
            final = openai.relayed_usage_chunk(state.template,
                                               usage=self._public_usage(usage) if usage is not None else None)
            await response.write(openai.sse(final, compact=False))
        await response.write(openai.DONE)
        await response.write_eof()
        return response


async def serve(router: Router, *, host: str, port: int, drain_seconds: float = 30.0,
                drain_quiet_seconds: float = 0.0, ready: Callable[[], None] | None = None) -> None:
    """Run ``router`` on ``host:port`` until SIGTERM/SIGINT, then drain (see ``Router.drain``) and stop."""
    # Handler cancellation: a client that closes its connection cancels its request's handler, and with it
    # the upstream requests (their connections closed, so the engines drop the sequences and free the slots).
    runner = web.AppRunner(router.app(), access_log=None, handle_signals=False, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, host, port, reuse_address=True)
    await site.start()
    log.info("event=ready host=%s port=%d mode=%s", host, port, "colocated" if router.colocated else "pd")
    if ready is not None:
        ready()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
        log.info("event=draining in_flight=%d timeout_s=%.0f quiet_s=%.0f", router._in_flight, drain_seconds,
                 drain_quiet_seconds)
        await router.drain(timeout_seconds=drain_seconds, quiet_seconds=drain_quiet_seconds)
        log.info("event=drained in_flight=%d served_while_draining=%d", router._in_flight,
                 router.drained_requests)
    finally:
        await runner.cleanup()
        log.info("event=stopped")
