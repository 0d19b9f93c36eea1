"""``daybreak router``: the OpenAI-compatible front of a PDDeployment (prefill, then decode, pool-aware).

Engines come from the role Services' EndpointSlices (``--namespace``,
``--prefill-service``, ``--decode-service``) or from static lists
(``--prefill-endpoints``, ``--decode-endpoints``). Without prefill pods
configured the router is colocated: one step per request on ``both`` engines.
Pool lookups need ``--kv-layout`` (block keys) and the pool (``--pool-ref`` or
``--pool-endpoints``, token); each request's kvNamespace is that of its
engine pods (their ``daybreak.dev/kv-namespace`` label; ``--kv-namespace`` for
static endpoints), so an upgrade to a new one needs no router restart. Without them the router routes on
load alone, which is what a vLLM deployment without the prefix API gets.
Limits and privacy (``--auth-dir``, ``--max-concurrent-per-client``,
``--request-timeout-seconds``, ``--max-model-len``, ``--cache-statistics``,
``--debug-headers``) are described in ``serving.router.server`` and
docs/security.md; so is holding requests while engines start from zero
(``--hold-queue``, ``--hold-seconds``; docs/serving.md).
Every flag has the environment fallback named in its help, so the operator's
pod env configures it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from daybreak.logs import setup_logging
from daybreak.serving.router.choice import CostModel
from daybreak.serving.router.limits import DEFAULT_MAX_CONCURRENT_PER_CLIENT
from daybreak.serving.router.server import DEFAULT_HOLD_QUEUE, DEFAULT_HOLD_SECONDS, RouterConfig

log = logging.getLogger(__name__)


def _env(name: str, default: str | None = None) -> str | None:
    value = os.environ.get(name)
    return value if value not in (None, "") else default


def _list(value: str | None) -> list[str]:
    return [v.strip() for v in (value or "").split(",") if v.strip()]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("serving")
    g.add_argument("--host", default=_env("POD_IP", "127.0.0.1"), help="address to bind ($POD_IP, else 127.0.0.1)")
    g.add_argument("--port", type=int, default=int(_env("DAYBREAK_ROUTER_PORT", "8000") or 8000),
                   help="port ($DAYBREAK_ROUTER_PORT, 8000)")
    d = parser.add_argument_group("engine discovery")
    d.add_argument("--namespace", default=_env("POD_NAMESPACE"), help="namespace of the role Services "
                   "($POD_NAMESPACE)")
    d.add_argument("--prefill-service", default=_env("DAYBREAK_PREFILL_SERVICE"),
                   help="prefill Service whose EndpointSlices list the pods ($DAYBREAK_PREFILL_SERVICE)")
    d.add_argument("--decode-service", default=_env("DAYBREAK_DECODE_SERVICE"),
                   help="decode Service ($DAYBREAK_DECODE_SERVICE)")
    d.add_argument("--prefill-endpoints", default=_env("DAYBREAK_PREFILL_ENDPOINTS"),
                   help="static prefill pods host:port,... instead of a Service ($DAYBREAK_PREFILL_ENDPOINTS)")
    d.add_argument("--decode-endpoints", default=_env("DAYBREAK_DECODE_ENDPOINTS"),
                   help="static decode pods ($DAYBREAK_DECODE_ENDPOINTS); with no prefill pods configured "
                   "these are 'both' engines and the router is colocated")
    d.add_argument("--kubeconfig", default=None, help="kubeconfig for discovery (default $KUBECONFIG, else the "
                   "in-cluster ServiceAccount)")
    d.add_argument("--refresh-seconds", type=float, default=1.0,
                   help="EndpointSlice re-read period while their watch is not running (with it, a change is "
                        "read at once and everything every 10 s)")
    d.add_argument("--scrape-seconds", type=float, default=0.5, help="period of the /metrics load scrape")
    p = parser.add_argument_group("pool lookups")
    # Defaults None: unset flags fall back to the engine-pod contract (api.enginepod; with_pod_env).
    p.add_argument("--pool-ref", default=None,
                   help="NS/NAME of the KVPool whose status.endpoints list the agents ($DAYBREAK_POOL_REF); "
                   "wins over --pool-endpoints")
    p.add_argument("--pool-endpoints", default=None,
                   help="agents host:port,... ($DAYBREAK_POOL_ENDPOINTS)")
    p.add_argument("--token", default=None, help="pool token (either flag replaces $DAYBREAK_POOL_TOKEN_FILE / "
                   "$DAYBREAK_POOL_TOKEN; a file wins over a token)")
    p.add_argument("--token-file", default=None, help="file holding the pool token")
    p.add_argument("--kv-namespace", default=None,
                   help="kvNamespace of engine pods without the daybreak.dev/kv-namespace label, i.e. static "
                   "endpoints ($DAYBREAK_KV_NAMESPACE); discovered pods carry their own")
    p.add_argument("--kv-layout", default=None,
                   help="kvLayout JSON, e.g. '{\"numLayers\":32,\"numKVHeads\":8,\"headDim\":128,"
                   "\"blockTokens\":16}' ($DAYBREAK_KV_LAYOUT); without it: no block keys, load only")
    p.add_argument("--no-pool-lookup", action="store_true",
                   help="never ask the pool (engine-local prefix affinity still works with --kv-layout)")
    p.add_argument("--pool-clients", type=int, default=4, help="parallel pool lookups")
    p.add_argument("--pool-tls-ca", default="", metavar="FILE",
                   help="speak TLS to the agents, checking them against this CA bundle "
                        "(default $DAYBREAK_POOL_TLS_CA_FILE; unset: plain tcp)")
    r = parser.add_argument_group("retries and choice")
    r.add_argument("--deadline-seconds", type=float, default=float(_env("DAYBREAK_ROUTER_DEADLINE_SECONDS", "60")
                                                                   or 60),
                   help="retry a failed step only this long after the request arrived "
                   "($DAYBREAK_ROUTER_DEADLINE_SECONDS, 60)")
    r.add_argument("--max-attempts", type=int, default=int(_env("DAYBREAK_ROUTER_MAX_ATTEMPTS", "3") or 3),
                   help="tries per step ($DAYBREAK_ROUTER_MAX_ATTEMPTS, 3)")
    r.add_argument("--connect-timeout-seconds", type=float, default=2.0, help="connecting to an engine")
    r.add_argument("--idle-timeout-seconds", type=float, default=60.0,
                   help="an engine silent this long has failed the step")
    defaults = CostModel()
    r.add_argument("--compute-block-seconds", type=float, default=defaults.compute_block_seconds,
                   help="cost estimate: computing one block")
    r.add_argument("--load-block-seconds", type=float, default=defaults.load_block_seconds,
                   help="cost estimate: loading one block from the pool")
    r.add_argument("--queue-seconds", type=float, default=defaults.queue_seconds,
                   help="cost estimate: one request running or waiting on the pod")
    a = parser.add_argument_group("limits and privacy")
    a.add_argument("--auth-dir", default=_env("DAYBREAK_ROUTER_AUTH_DIR"),
                   help="require a bearer token on /v1/*: a directory with one file per credential (a mounted "
                   "Secret), the file's name the client's name, its text the token ($DAYBREAK_ROUTER_AUTH_DIR; "
                   "unset: no auth, clients known by address)")
    a.add_argument("--max-concurrent-per-client", type=int,
                   default=int(_env("DAYBREAK_ROUTER_MAX_CONCURRENT_PER_CLIENT",
                                    str(DEFAULT_MAX_CONCURRENT_PER_CLIENT)) or DEFAULT_MAX_CONCURRENT_PER_CLIENT),
                   help="requests in flight per client (its credential, else its address); more get 429; 0: no "
                   f"limit ($DAYBREAK_ROUTER_MAX_CONCURRENT_PER_CLIENT, {DEFAULT_MAX_CONCURRENT_PER_CLIENT})")
    a.add_argument("--request-timeout-seconds", type=float,
                   default=float(_env("DAYBREAK_ROUTER_REQUEST_TIMEOUT_SECONDS", "600") or 600),
                   help="every request ends this long after it arrived, streams included "
                   "($DAYBREAK_ROUTER_REQUEST_TIMEOUT_SECONDS, 600)")
    a.add_argument("--max-model-len", type=int, default=int(_env("DAYBREAK_ROUTER_MAX_MODEL_LEN", "0") or 0),
                   help="the model's context length: max_tokens over it minus the prompt is refused with 400 "
                   "($DAYBREAK_ROUTER_MAX_MODEL_LEN; 0: learnt from the engines' /v1/models max_model_len)")
    a.add_argument("--cache-statistics", action="store_true",
                   default=_env("DAYBREAK_ROUTER_CACHE_STATISTICS", "") in ("1", "true"),
                   help="report usage.prompt_tokens_details.cached_tokens and usage.daybreak to clients "
                   "($DAYBREAK_ROUTER_CACHE_STATISTICS; off: they would tell a client what others sent)")
    a.add_argument("--debug-headers", action="store_true",
                   help="name the pods that served a request, the prefill outcome and the kvNamespace in "
                   "x-daybreak-* response headers (tests, benchmarks; they expose internal addresses)")
    h = parser.add_argument_group("holding requests while engines start (scale from zero)")
    h.add_argument("--hold-queue", type=int,
                   default=int(_env("DAYBREAK_ROUTER_HOLD_QUEUE", str(DEFAULT_HOLD_QUEUE)) or DEFAULT_HOLD_QUEUE),
                   help="requests held at once while a role has no ready engine; more get 503 with Retry-After; "
                   "0: no holding and no held-requests gauge, so the planner keeps a pod per role "
                   f"($DAYBREAK_ROUTER_HOLD_QUEUE, {DEFAULT_HOLD_QUEUE})")
    h.add_argument("--hold-seconds", type=float,
                   default=float(_env("DAYBREAK_ROUTER_HOLD_SECONDS", str(DEFAULT_HOLD_SECONDS))
                                 or DEFAULT_HOLD_SECONDS),
                   help="a held request waits at most this long from its arrival for the engines to start, then "
                   f"503 with Retry-After ($DAYBREAK_ROUTER_HOLD_SECONDS, {DEFAULT_HOLD_SECONDS:g})")
    h.add_argument("--prefill-concurrency", type=int,
                   default=int(_env("DAYBREAK_ROUTER_PREFILL_CONCURRENCY", "0") or 0),
                   help="prefill steps in flight at once on one prefill pod; more wait in the hold queue (first "
                   "come, first served) for the first pod with room, one that just started included, and count "
                   "in the held-requests gauge the planner reads; 0: no bound, each request goes to the "
                   "least-loaded pod when it arrives and waits in that pod's queue "
                   "($DAYBREAK_ROUTER_PREFILL_CONCURRENCY, 0)")
    h.add_argument("--decode-prefill", type=int,
                   default=int(_env("DAYBREAK_ROUTER_DECODE_PREFILL", "0") or 0),
                   help="with --prefill-concurrency: prompts per ready decode pod that decode may compute itself, "
                   "in flight at once, for requests that would wait for prefill room; 0: they always wait "
                   "($DAYBREAK_ROUTER_DECODE_PREFILL, 0)")
    h.add_argument("--ttft-target", type=float,
                   default=float(_env("DAYBREAK_ROUTER_TTFT_TARGET", "0") or 0),
                   help="with --prefill-concurrency: requests waiting for prefill room that can still have "
                   "their first token within this many seconds of arriving go before those that cannot "
                   "(which miss it wherever they wait); 0: first come, first served "
                   "($DAYBREAK_ROUTER_TTFT_TARGET, 0)")
    parser.add_argument("--drain-seconds", type=float, default=30.0, help="SIGTERM: serve at most this long "
                        "before stopping (in-flight requests and those still arriving)")
    parser.add_argument("--drain-quiet-seconds", type=float, default=0.0,
                        help="SIGTERM: stop once nothing is in flight and no request came for this long (0: as "
                        "soon as idle); behind a Service give it the endpoint propagation time plus the "
                        "clients' keep-alive idle timeout (the operator renders 15)")
    parser.add_argument("--log-level", default=_env("DAYBREAK_LOG_LEVEL", "INFO"))


def block_tokens_of(layout_json: str | None) -> int | None:
    """``blockTokens`` of a kvLayout JSON (validated by the API model); None when no layout is given."""
    if not layout_json:
        return None
    from daybreak.api.kvcompat import KVLayout

    try:
        layout = KVLayout.model_validate(json.loads(layout_json))
    except (ValueError, TypeError) as exc:
        raise SystemExit(f"--kv-layout: not a valid kvLayout ({exc}); give JSON like "
                         "'{\"numLayers\":32,\"numKVHeads\":8,\"headDim\":128,\"blockTokens\":16}'") from None
    return int(layout.block_tokens)


def with_pod_env(args: argparse.Namespace, env: Mapping[str, str] | None = None) -> argparse.Namespace:
    """``args`` with the pool flags left unset filled from the engine-pod contract (``api.enginepod``, parsed
    from ``env``, default ``os.environ``), and ``token`` resolved with every engine's one precedence: the
    flags' pair if given, else the environment's; within one, a file wins (``client.env.read_pool_token``)."""
    from daybreak.api.enginepod import EnginePodEnvError
    from daybreak.client.env import engine_pod_env, read_pool_token

    try:
        pod = engine_pod_env(env)
        if args.token or args.token_file:
            token = read_pool_token(token=args.token or "", token_file=args.token_file or "", source="--token-file")
        else:
            token = read_pool_token(token=pod.pool_token, token_file=pod.pool_token_file,
                                    source="$DAYBREAK_POOL_TOKEN_FILE")
    except EnginePodEnvError as exc:
        raise SystemExit(str(exc)) from None
    layout = json.dumps(pod.kv_layout.to_dict(), sort_keys=True) if pod.kv_layout else None
    return argparse.Namespace(**{
        **vars(args),
        "pool_ref": args.pool_ref if args.pool_ref is not None else (pod.pool_ref or None),
        "pool_endpoints": (args.pool_endpoints if args.pool_endpoints is not None
                           else ",".join(pod.pool_endpoints) or None),
        "kv_namespace": args.kv_namespace if args.kv_namespace is not None else (pod.kv_namespace or None),
        "kv_layout": args.kv_layout if args.kv_layout is not None else layout,
        "token": token or None, "token_file": None,
    })


def _token(args: argparse.Namespace) -> str | None:
    """The credential ``with_pod_env`` resolved."""
    return str(args.token) if args.token else None


async def _main(args: argparse.Namespace) -> int:
    args = with_pod_env(args)
    from daybreak.serving import kube
    from daybreak.serving.router.auth import AuthConfigError, Credentials
    from daybreak.serving.router.discovery import RolePods, service_lister, service_watch
    from daybreak.serving.router.pool_lookup import PoolLookup
    from daybreak.serving.router.server import Router, serve

    block_tokens = block_tokens_of(args.kv_layout)
    for flag, value in (("--max-concurrent-per-client", args.max_concurrent_per_client),
                        ("--max-model-len", args.max_model_len), ("--hold-queue", args.hold_queue),
                        ("--prefill-concurrency", args.prefill_concurrency),
                        ("--decode-prefill", args.decode_prefill)):
        if value < 0:
            raise SystemExit(f"{flag}: {value} is negative; give 0 (the default behaviour) or more")
    if args.decode_prefill and not args.prefill_concurrency:
        raise SystemExit("--decode-prefill needs --prefill-concurrency: only then does the router know prefill "
                         "has no room")
    if not args.ttft_target >= 0:
        raise SystemExit(f"--ttft-target: {args.ttft_target} is negative; give 0 (first come, first served) or "
                         "more")
    if args.ttft_target and not args.prefill_concurrency:
        raise SystemExit("--ttft-target needs --prefill-concurrency: only then do requests wait in the router "
                         "for prefill room")
    if not args.request_timeout_seconds > 0:
        raise SystemExit(f"--request-timeout-seconds: {args.request_timeout_seconds} must be positive")
    if not args.hold_seconds > 0:
        raise SystemExit(f"--hold-seconds: {args.hold_seconds} must be positive (--hold-queue 0 turns holding off)")
    auth: Credentials | None = None
    if args.auth_dir:
        try:
            auth = Credentials(Path(args.auth_dir))
        except AuthConfigError as exc:
            raise SystemExit(str(exc)) from None
    config = RouterConfig(
        block_tokens=block_tokens, deadline_seconds=args.deadline_seconds, max_attempts=max(args.max_attempts, 1),
        connect_timeout_seconds=args.connect_timeout_seconds, idle_timeout_seconds=args.idle_timeout_seconds,
        cost=CostModel(compute_block_seconds=args.compute_block_seconds,
                       load_block_seconds=args.load_block_seconds, queue_seconds=args.queue_seconds),
        request_timeout_seconds=args.request_timeout_seconds,
        max_concurrent_per_client=args.max_concurrent_per_client, max_model_len=args.max_model_len or None,
        cache_statistics=args.cache_statistics, debug_headers=args.debug_headers,
        hold_queue=args.hold_queue, hold_seconds=args.hold_seconds, prefill_concurrency=args.prefill_concurrency,
        decode_prefill=args.decode_prefill, ttft_target_seconds=args.ttft_target or None)
    api: Any = None

    async def need_api() -> Any:
        nonlocal api
        if api is None:
            api = await kube.load_api(args.kubeconfig)
        return api

    def role(name: str, service: str | None, static: str | None) -> RolePods | None:
        if static:
            return RolePods(name, static=_list(static), scrape_seconds=args.scrape_seconds)
        if service:
            if not args.namespace:
                raise SystemExit(f"--{name}-service needs --namespace (or $POD_NAMESPACE)")
            return RolePods(name, lister=service_lister(api, namespace=args.namespace, service=service),
                            watch=service_watch(api, namespace=args.namespace, service=service),
                            refresh_seconds=args.refresh_seconds, scrape_seconds=args.scrape_seconds)
        return None

    if ((args.prefill_service and not args.prefill_endpoints)
            or (args.decode_service and not args.decode_endpoints)):
        await need_api()
    prefill = role("prefill", args.prefill_service, args.prefill_endpoints)
    decode = role("decode", args.decode_service, args.decode_endpoints)
    if decode is None:
        raise SystemExit("no decode pods configured: give --decode-service (with --namespace) or "
                         "--decode-endpoints")

    pool: PoolLookup | None = None
    if block_tokens and not args.no_pool_lookup and (args.pool_ref or args.pool_endpoints):
        token = _token(args)
        if not token:
            raise SystemExit("pool lookups need --token (or --token-file); "
                             "or pass --no-pool-lookup to route on load and engine-local prefixes only")
        if args.pool_ref:
            namespace, _, name = str(args.pool_ref).partition("/")
            if not namespace or not name:
                raise SystemExit(f"--pool-ref {args.pool_ref!r}: give NAMESPACE/NAME")
            kube_api = await need_api()

            async def endpoints() -> list[str]:
                return await kube.pool_endpoints(kube_api, namespace=namespace, pool=name)
        else:
            static = _list(args.pool_endpoints)

            async def endpoints() -> list[str]:
                return static
        from daybreak.client import pool_tls_ca_file
        from daybreak.pool.credentials import CredentialError
        from daybreak.pool.tls import TlsSettingsError

        try:
            tls_ca_file = pool_tls_ca_file(override=args.pool_tls_ca)
        except TlsSettingsError as exc:
            raise SystemExit(f"--pool-tls-ca: {exc}") from None
        try:
            pool = PoolLookup(endpoints=endpoints, token=token, namespace=args.kv_namespace,
                              clients=max(args.pool_clients, 1), tls_ca_file=tls_ca_file)
        except CredentialError as exc:
            raise SystemExit(f"--token: {exc}") from None

    log.info("event=settings mode=%s prefill=%s decode=%s pool_lookup=%s block_tokens=%s deadline_s=%.1f "
             "max_attempts=%d cost=%s auth=%s credentials=%d max_concurrent_per_client=%d request_timeout_s=%g "
             "max_model_len=%s cache_statistics=%s debug_headers=%s hold_queue=%d hold_s=%g prefill_concurrency=%d "
             "decode_prefill=%d ttft_target_s=%s", "colocated" if prefill is None else "pd",
             args.prefill_service or args.prefill_endpoints or "-", args.decode_service or args.decode_endpoints,
             "pool-ref:" + args.pool_ref if pool and args.pool_ref else ("static" if pool else "off"),
             block_tokens, config.deadline_seconds, config.max_attempts, config.cost,
             "bearer" if auth else "off", len(auth.names) if auth else 0, config.max_concurrent_per_client,
             config.request_timeout_seconds, config.max_model_len or "from-engines", config.cache_statistics,
             config.debug_headers, config.hold_queue, config.hold_seconds, config.prefill_concurrency,
             config.decode_prefill, config.ttft_target_seconds or "-")
    router = Router(config=config, prefill=prefill, decode=decode, pool=pool, kv_namespace=args.kv_namespace,
                    auth=auth)
    try:
        await serve(router, host=args.host, port=args.port, drain_seconds=args.drain_seconds,
                    drain_quiet_seconds=args.drain_quiet_seconds)
    finally:
        if api is not None:
            await api.close()
    return 0


def run(args: argparse.Namespace) -> int:
    setup_logging(args.log_level)
    return asyncio.run(_main(args))
