"""``daybreak sim-engine``: a simulated prefill/decode engine that serves OpenAI HTTP and moves real KV.

Settings come from flags; an unset flag falls back to the operator's engine-pod
contract (``api.enginepod.EnginePodEnv``: ``DAYBREAK_ROLE``, ``DAYBREAK_POOL_REF``,
``DAYBREAK_POOL_ENDPOINTS``, ``DAYBREAK_POOL_TOKEN`` / ``_FILE``, ``DAYBREAK_KV_NAMESPACE``,
``DAYBREAK_KV_LAYOUT``, ``DAYBREAK_BLOCK_BYTES``, ``DAYBREAK_TRANSPORTS``, ``DAYBREAK_MODEL``,
``DAYBREAK_ENGINE_PORT``, ``DAYBREAK_POOL_TLS_CA_FILE``) and ``POD_IP``; they are gathered
in one ``Settings`` object, printed at start-up. See docs/serving.md.

SIGTERM drains: ``/health`` turns 503 at once, accepted requests finish, the
engine-local blocks the pool does not hold are written to it (hottest first,
within the drain budget), then the process exits 0. A second SIGTERM, or ``--drain-seconds`` passing, exits
at once with 1.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from aiohttp import web

from daybreak.api.kvcompat import KVLayout
from daybreak.client import KVPoolClient, KVPoolError, pool_tls_ca_file
from daybreak.client.env import engine_pod_env, read_pool_token
from daybreak.logs import setup_logging
from daybreak.serving.sim.costmodel import CostModel, knob_names
from daybreak.serving.sim.engine import Engine, EngineConfig, Role
from daybreak.serving.sim.kv import PoolIO
from daybreak.serving.sim.metrics import PromMetrics
from daybreak.serving.sim.server import SimServer

log = logging.getLogger(__name__)

# The example deployment's model (examples/): Llama-3.1-8B, 16-token bf16 blocks of 2 MiB.
_REFRESH_SECONDS = 5.0  # how often --pool-ref re-reads the KVPool's status.endpoints
DEFAULT_LAYOUT = {"numLayers": 32, "numKVHeads": 8, "headDim": 128, "dtype": "bfloat16", "blockTokens": 16}


@dataclass(frozen=True)
class Settings:
    """Everything one sim engine process runs with."""

    host: str
    port: int
    role: Role
    model: str
    kv_namespace: str
    layout: KVLayout
    block_bytes: int
    pool_endpoints: list[str] = field(default_factory=list)
    pool_ref: str = ""
    token: str = field(default="", repr=False)
    no_pool: bool = False
    engine: EngineConfig = field(default_factory=EngineConfig)
    max_model_len: int = 131072
    drain_seconds: float = 30.0
    pool_workers: int = 4
    pool_tls_ca_file: str | None = None
    """CA bundle the agents' TLS certificates are checked against; None: plain tcp."""
    startup_seconds: float = 0.0
    """Simulated model loading: /health stays 503 this long after the listen socket opens."""
    transports: tuple[str, ...] = ()
    """The pool's transports, most preferred first ($DAYBREAK_TRANSPORTS); empty: all."""

    @property
    def client_transport(self) -> Literal["auto", "tcp"]:
        """``KVPoolClient``'s transport: shared memory with same-node agents only when the pool allows shm."""
        return "auto" if not self.transports or "shm" in self.transports else "tcp"

    def describe(self) -> str:
        """One log line of key=value pairs (the token left out)."""
        cost = " ".join(f"{k}={getattr(self.engine.cost, k)}" for k in knob_names())
        return (f"host={self.host} port={self.port} role={self.role.value} model={self.model} "
                f"kv_namespace={self.kv_namespace} block_tokens={self.layout.block_tokens} "
                f"block_bytes={self.block_bytes} model_block_bytes={self.layout.bytes_per_block} "
                f"pool={'none' if self.no_pool else (self.pool_ref or ','.join(self.pool_endpoints))} "
                f"pool_tls={'ca:' + self.pool_tls_ca_file if self.pool_tls_ca_file else 'off'} "
                f"transports={','.join(self.transports) or 'all'} "
                f"max_batch={self.engine.max_batch} max_step_tokens={self.engine.max_step_tokens} "
                f"local_cache_blocks={self.engine.local_cache_blocks} startup_seconds={self.startup_seconds:g} {cost}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The sim engine's flags (defaults from the environment where the operator sets it)."""
    # Defaults None: unset flags fall back to the engine-pod contract (api.enginepod), read in settings_from.
    parser.add_argument("--host", default=os.environ.get("POD_IP") or "127.0.0.1",
                        help="address to listen on (default $POD_IP, else 127.0.0.1)")
    parser.add_argument("--port", type=int, default=None,
                        help="HTTP port (default $DAYBREAK_ENGINE_PORT, else 8000)")
    parser.add_argument("--role", choices=[r.value for r in Role], default=None,
                        help="prefill (kv producer), decode (kv consumer) or both ($DAYBREAK_ROLE, else both)")
    parser.add_argument("--model", default=None,
                        help="model name served and used as the metrics' model_name ($DAYBREAK_MODEL, else sim)")
    parser.add_argument("--pool-endpoints", default=None,
                        help="comma list of pool agents host:port ($DAYBREAK_POOL_ENDPOINTS)")
    parser.add_argument("--pool-ref", default=None, metavar="NS/NAME",
                        help="read the agents from KVPool NS/NAME's status.endpoints through the API "
                             "($DAYBREAK_POOL_REF)")
    parser.add_argument("--token", default=None,
                        help="pool token; prefer --token-file (either flag replaces $DAYBREAK_POOL_TOKEN_FILE / "
                             "$DAYBREAK_POOL_TOKEN; a file wins over a token)")
    parser.add_argument("--token-file", default=None, help="file holding the pool token")
    parser.add_argument("--pool-tls-ca", default="", metavar="FILE",
                        help="speak TLS to the agents, checking them against this CA bundle "
                             "(default $DAYBREAK_POOL_TLS_CA_FILE; unset: plain tcp)")
    parser.add_argument("--kv-namespace", default=None,
                        help="the deployment's kvNamespace ($DAYBREAK_KV_NAMESPACE, else sim)")
    parser.add_argument("--kv-layout", default=None,
                        help="kvLayout as JSON ($DAYBREAK_KV_LAYOUT; default Llama-3.1-8B, 16-token blocks)")
    parser.add_argument("--block-bytes", type=int, default=None,
                        help="bytes per block actually moved ($DAYBREAK_BLOCK_BYTES; default: the layout's; "
                             "smaller scales KV down for tests and benchmarks, the cost model still charges the "
                             "layout's size)")
    parser.add_argument("--no-pool", action="store_true",
                        help="run without a pool: the engine-local prefix cache only (benchmark baseline)")
    defaults = EngineConfig()
    parser.add_argument("--max-num-seqs", "--max-batch", dest="max_batch", type=int, default=defaults.max_batch,
                        help=f"running sequences at most, vLLM's flag (the planner reads it from engine.args; "
                             f"default {defaults.max_batch})")
    parser.add_argument("--max-step-tokens", type=int, default=defaults.max_step_tokens,
                        help=f"token budget of one step, the chunked-prefill size (default {defaults.max_step_tokens})")
    parser.add_argument("--local-cache-blocks", type=int, default=defaults.local_cache_blocks,
                        help=f"engine-local prefix cache capacity in blocks (default {defaults.local_cache_blocks})")
    parser.add_argument("--max-model-len", type=int, default=131072,
                        help="context length in tokens: prompt plus max_tokens must fit (default 131072)")
    parser.add_argument("--drain-seconds", type=float, default=30.0,
                        help="on SIGTERM, wait this long for in-flight requests before exiting anyway")
    parser.add_argument("--pool-workers", type=int, default=4, help="parallel pool clients (threads)")
    parser.add_argument("--startup-seconds", type=float, default=0.0,
                        help="simulated model loading: stay unready (/health 503) this long after start "
                             "(real engines take tens of seconds to minutes; default 0)")
    cost = CostModel()
    for name in knob_names():
        flag = "--" + name.replace("_", "-")
        parser.add_argument(flag, type=float, default=getattr(cost, name), dest=f"cost_{name}",
                            help=f"cost model: {name} (default {getattr(cost, name)})")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


def settings_from(args: argparse.Namespace, env: Mapping[str, str] | None = None) -> Settings:
    """Validate the flags, over the engine-pod contract parsed from ``env`` (default ``os.environ``), into
    ``Settings``; raises ValueError saying which flag or variable to fix."""
    pod = engine_pod_env(env)
    if args.kv_layout:
        try:
            layout = KVLayout.model_validate(json.loads(args.kv_layout))
        except (ValueError, TypeError) as exc:
            raise ValueError(f"--kv-layout: not a valid kvLayout JSON object ({exc})") from None
    else:
        layout = pod.kv_layout or KVLayout.model_validate(DEFAULT_LAYOUT)
    block_bytes = (args.block_bytes if args.block_bytes is not None else pod.block_bytes) or layout.bytes_per_block
    if block_bytes < 1 or block_bytes > 1 << 30:
        raise ValueError(f"--block-bytes: {block_bytes} is outside 1..1Gi")
    # The one credential precedence (client.env.read_pool_token): the flags' pair, if given, replaces the env's.
    if args.token or args.token_file:
        token = read_pool_token(token=args.token or "", token_file=args.token_file or "", source="--token-file")
    else:
        token = read_pool_token(token=pod.pool_token, token_file=pod.pool_token_file,
                                source="$DAYBREAK_POOL_TOKEN_FILE")
    endpoints = ([e.strip() for e in args.pool_endpoints.split(",") if e.strip()] if args.pool_endpoints is not None
                 else list(pod.pool_endpoints))
    pool_ref = args.pool_ref if args.pool_ref is not None else pod.pool_ref
    if pool_ref and pool_ref.count("/") != 1:
        raise ValueError(f"--pool-ref: give NAMESPACE/NAME, got {pool_ref!r}")
    role = Role(args.role or pod.role or "both")
    kv_namespace = args.kv_namespace or pod.kv_namespace or "sim"
    if not args.no_pool:
        if not endpoints and not pool_ref:
            raise ValueError("no pool: give --pool-endpoints (or $DAYBREAK_POOL_ENDPOINTS) or --pool-ref "
                             "(or $DAYBREAK_POOL_REF), or --no-pool to run with the engine-local cache only")
        if not token:
            raise ValueError("no pool token: give --token-file, --token, $DAYBREAK_POOL_TOKEN_FILE or "
                             "$DAYBREAK_POOL_TOKEN")
    cost = CostModel(**{name: getattr(args, f"cost_{name}") for name in knob_names()})
    engine = EngineConfig(role=role, namespace=kv_namespace, block_tokens=layout.block_tokens,
                          block_bytes=block_bytes, model_block_bytes=layout.bytes_per_block,
                          max_batch=args.max_batch, max_step_tokens=args.max_step_tokens,
                          local_cache_blocks=args.local_cache_blocks, cost=cost)
    if args.pool_workers < 1:
        raise ValueError("--pool-workers must be at least 1")
    if not 0 <= args.startup_seconds <= 3600:
        raise ValueError(f"--startup-seconds: {args.startup_seconds} is outside 0..3600")
    tls_ca_file = None if args.no_pool else pool_tls_ca_file(env, override=args.pool_tls_ca)
    return Settings(host=args.host, port=args.port or pod.engine_port or 8000, role=role,
                    model=args.model or pod.model or "sim", kv_namespace=kv_namespace, layout=layout,
                    block_bytes=block_bytes, pool_endpoints=endpoints, pool_ref=pool_ref, token=token,
                    no_pool=args.no_pool, transports=tuple(pod.transports),
                    engine=engine, max_model_len=args.max_model_len, drain_seconds=args.drain_seconds,
                    pool_workers=args.pool_workers, pool_tls_ca_file=tls_ca_file,
                    startup_seconds=args.startup_seconds)


class _Endpoints:
    """Where the pool's agents are: the flag's list, or KVPool NS/NAME's status.endpoints read through the API."""

    def __init__(self, settings: Settings) -> None:
        self._settings = settings
        self._api: Any = None

    async def read(self) -> list[str]:
        if not self._settings.pool_ref:
            return self._settings.pool_endpoints
        from daybreak.client import discovery  # the Kubernetes client is loaded only when asked for

        namespace, name = discovery.parse_pool_ref(self._settings.pool_ref)
        if self._api is None:
            self._api = await discovery.load_api()
        return await discovery.pool_endpoints(self._api, namespace=namespace, pool=name)

    async def close(self) -> None:
        if self._api is not None:
            await self._api.close()
            self._api = None


async def _connect_pool(settings: Settings, stop: asyncio.Event) -> PoolIO | None:
    """The pool, retried until an agent answers (the pool may start after the engine), or None on stop.

    With ``--pool-ref`` the endpoints are re-read from the KVPool's status every few seconds, and a
    client that lost every agent reconnects to the endpoints as they are then.
    """
    current: list[str] = []
    source = _Endpoints(settings)

    def connect() -> KVPoolClient:
        if not current:
            raise KVPoolError(f"KVPool {settings.pool_ref} publishes no endpoints yet")
        return KVPoolClient(list(current), token=settings.token, namespace=settings.kv_namespace,
                            tls_ca_file=settings.pool_tls_ca_file, transport=settings.client_transport,
                            transports=settings.transports or None)

    async def refresh() -> None:
        try:
            endpoints = await source.read()
        except Exception as exc:  # the Kubernetes client's errors vary: keep the last endpoints, say why
            log.warning("event=pool_endpoints_unreadable pool=%s error=%s", settings.pool_ref, exc)
            return
        if endpoints and endpoints != current:
            log.info("event=pool_endpoints endpoints=%s", ",".join(endpoints))
            current[:] = endpoints

    delay = 0.5
    while not stop.is_set():
        await refresh()
        pool = PoolIO(connect=connect, namespace=settings.kv_namespace, block_bytes=settings.block_bytes,
                      workers=settings.pool_workers)
        try:
            await pool.start()
        except (KVPoolError, OSError) as exc:
            await pool.close()
            log.warning("event=pool_unreachable error=%s retry_seconds=%.1f", exc, delay)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), delay)
            delay = min(delay * 2, 5.0)
            continue
        log.info("event=pool_connected endpoints=%s", ",".join(current))
        if settings.pool_ref:
            async def keep_refreshing() -> None:
                try:
                    while True:
                        await asyncio.sleep(_REFRESH_SECONDS)
                        await refresh()
                finally:
                    await source.close()

            pool.background = asyncio.get_running_loop().create_task(keep_refreshing(), name="pool-endpoints")
        return pool
    await source.close()
    return None


async def serve(settings: Settings, *, on_ready: Callable[[], None] | None = None) -> int:
    """Run the engine until SIGTERM/SIGINT has drained it; returns the exit code."""
    metrics = PromMetrics(model_name=settings.model)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    signals = 0
    forced = asyncio.Event()

    def on_signal() -> None:
        nonlocal signals
        signals += 1
        if signals == 1:
            log.info("event=draining reason=signal")
            stop.set()
        else:
            log.warning("event=forced_exit reason=second_signal")
            forced.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal)

    engine = Engine(settings.engine, pool=None, metrics=metrics)
    server = SimServer(engine, metrics, model=settings.model, max_model_len=settings.max_model_len)
    # Handler cancellation: a client (the router) that closes its connection cancels the handler, which
    # drops the request from the batch; without it a non-streamed request ran to max_tokens for nobody.
    runner = web.AppRunner(server.app, access_log=None, handle_signals=False, shutdown_timeout=1.0,
                           handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, settings.host, settings.port, reuse_address=True)
    try:
        await site.start()
    except OSError as exc:
        log.error("event=listen_failed address=%s:%d error=%s", settings.host, settings.port, exc)
        await runner.cleanup()
        return 1
    pool: PoolIO | None = None
    if not settings.no_pool:
        pool = await _connect_pool(settings, stop)
    engine.pool = pool
    if settings.startup_seconds > 0 and not stop.is_set():
        # Model loading: the pod is Running but not Ready, as a real engine is while it loads weights, so
        # the planner's start-up time (decision to Ready) can be measured against 1 s, 30 s or 120 s.
        log.info("event=loading seconds=%g", settings.startup_seconds)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), settings.startup_seconds)
    engine.start()
    code = 0
    if not stop.is_set():
        server.ready = True
        log.info("event=ready address=%s:%d role=%s", settings.host, settings.port, settings.role.value)
        if on_ready is not None:
            on_ready()
        await stop.wait()
    server.draining = True
    drain_started = loop.time()
    drained = asyncio.ensure_future(server.wait_idle())
    forced_wait = asyncio.ensure_future(forced.wait())
    done, _ = await asyncio.wait({drained, forced_wait}, timeout=settings.drain_seconds,
                                 return_when=asyncio.FIRST_COMPLETED)
    if drained in done:
        log.info("event=drained in_flight=0")
    else:
        code = 1
        log.warning("event=drain_incomplete in_flight=%d reason=%s", server.active,
                    "second_signal" if forced_wait in done else "timeout")
    drained.cancel()
    forced_wait.cancel()
    if not forced.is_set():
        # Hand the engine-local blocks the pool lacks to the pool, so a scale-in loses no cache (within
        # what is left of the drain budget, itself inside the pod's termination grace period).
        blocks, sent = await engine.hand_off(seconds=settings.drain_seconds - (loop.time() - drain_started))
        log.info("event=handoff blocks=%d bytes=%d left=%d", blocks, sent, engine.cache.local_only)
    await runner.cleanup()
    await engine.stop()
    if pool is not None:
        await pool.close()
    log.info("event=stopped code=%d", code)
    return code


def run(args: argparse.Namespace) -> int:
    """CLI entry: ``daybreak sim-engine ...``."""
    setup_logging(args.log_level)
    try:
        settings = settings_from(args)
    except ValueError as exc:
        print(f"daybreak sim-engine: {exc}", file=sys.stderr)
        return 2
    log.info("event=settings %s", settings.describe())
    return asyncio.run(serve(settings))


__all__ = ["DEFAULT_LAYOUT", "Settings", "add_arguments", "run", "serve", "settings_from"]
