"""``daybreak operator``: run the operator, out of cluster with a kubeconfig or in cluster with its ServiceAccount.

The process campaigns for the leader Lease; while it holds it, it runs the
controller (workers, re-sync) and kopf's watches embedded in the same event
loop, and it tears both down the moment the Lease is lost. Standbys only
campaign. SIGTERM/SIGINT stop the term and release the Lease so a standby
takes over at once.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys
from typing import Any

import kopf
from pydantic import ValidationError

from daybreak.logs import setup_logging
from daybreak.operator import metrics
from daybreak.operator.controller import Controller
from daybreak.operator.kube import Credentials, KubeClient, load_configuration
from daybreak.operator.leader import LeaseElector, LeaseTiming, make_identity
from daybreak.operator.settings import OperatorSettings

logger = logging.getLogger(__name__)

KOPF_STOP_TIMEOUT = 5.0  # seconds kopf gets to wind down its watches before being cancelled


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--kubeconfig", help="kubeconfig file (default: in-cluster ServiceAccount, else "
                                             "$KUBECONFIG or ~/.kube/config)")
    scope = parser.add_mutually_exclusive_group()
    scope.add_argument("--namespace", "-n", help="watch only this namespace (comma-separated for several)")
    scope.add_argument("--all-namespaces", "-A", action="store_true", default=None,
                       help="watch every namespace (the default)")
    parser.add_argument("--metrics-port", type=int, help="port of /metrics (default 8080; 0 disables)")
    parser.add_argument("--metrics-address", help="address /metrics listens on (default 0.0.0.0)")
    parser.add_argument("--lease-name", help="name of the leader-election Lease (default daybreak-operator)")
    parser.add_argument("--lease-namespace", help="namespace of the Lease (default: own namespace in cluster, "
                                                  "else --namespace, else default)")
    parser.add_argument("--lease-duration", dest="lease_duration_seconds", type=float,
                        help="seconds a silent leader keeps the Lease (default 8)")
    parser.add_argument("--renew-deadline", dest="renew_deadline_seconds", type=float,
                        help="seconds a leader may fail to renew before it stops (default 5)")
    parser.add_argument("--retry-period", dest="retry_period_seconds", type=float,
                        help="seconds between renewals and campaign attempts (default 1)")
    parser.add_argument("--identity", help="this replica's identity in the Lease (default: hostname + suffix)")
    parser.add_argument("--resync", dest="resync_seconds", type=float,
                        help="seconds between level-based re-applies of every object (default 30)")
    parser.add_argument("--workers", type=int, help="objects reconciled concurrently (default 8)")
    parser.add_argument("--image", help="image for agents, routers and sim engines when a resource names none")
    parser.add_argument("--policy-dir", help="directory holding the pool policy (the chart's ConfigMap, one file "
                                             "per key); default: the built-in policy (docs/security.md)")
    parser.add_argument("--log-level", help="DEBUG, INFO, WARNING or ERROR (default INFO)")


def run(args: argparse.Namespace) -> int:
    overrides = {k: v for k, v in vars(args).items() if k not in ("command",)}
    try:
        settings = OperatorSettings.load(overrides=overrides)
    except ValidationError as exc:
        first = exc.errors()[0]
        field = ".".join(str(p) for p in first["loc"]) or "settings"
        print(f"daybreak operator: invalid {field}: {first['msg']}", file=sys.stderr)
        return 2
    except ValueError as exc:  # the policy directory is missing or unreadable
        print(f"daybreak operator: {exc}", file=sys.stderr)
        return 2
    configure_logging(settings.log_level)
    logger.info("starting operator %s", settings.describe())
    try:
        return asyncio.run(operate(settings))
    except KeyboardInterrupt:
        return 130


def configure_logging(level: str) -> None:
    # kopf narrates every watch event at INFO/DEBUG; only its problems belong in our log.
    setup_logging(level, quiet=("kopf", "aiohttp"))


def _lease_namespace(settings: OperatorSettings, creds: Credentials) -> str:
    if settings.lease_namespace:
        return settings.lease_namespace
    if creds.in_cluster and creds.default_namespace:
        return creds.default_namespace
    return (settings.namespaces or (None,))[0] or creds.default_namespace or "default"


async def operate(settings: OperatorSettings) -> int:
    """Campaign, lead, repeat; until a signal."""
    configuration, creds = await load_configuration(settings.kubeconfig,
                                                    service_account_dir=settings.service_account_dir)
    client = KubeClient(configuration)
    metrics.serve(settings.metrics_port, address=settings.metrics_address)
    metrics.LEADER.set(0)
    identity = make_identity(settings.identity)
    elector = LeaseElector(
        client, namespace=_lease_namespace(settings, creds), name=settings.lease_name, identity=identity,
        timing=LeaseTiming(settings.lease_duration_seconds, settings.renew_deadline_seconds,
                           settings.retry_period_seconds),
    )
    shutdown = asyncio.Event()
    _install_signals(shutdown)
    logger.info("operator ready identity=%s lease=%s/%s scope=%s server=%s", identity, elector.namespace,
                elector.name, settings.namespace or "all-namespaces", creds.server)
    try:
        while not shutdown.is_set():
            if not await _until_first(elector.acquire(), shutdown):
                break
            metrics.LEADER.set(1)
            try:
                await lead(settings, client, creds, elector, shutdown)
            finally:
                metrics.LEADER.set(0)
    finally:
        await elector.release()
        await client.close()
    logger.info("operator stopped identity=%s", identity)
    return 0


async def _until_first(coro: Any, shutdown: asyncio.Event) -> bool:
    """Run ``coro`` until it finishes (True) or shutdown is requested (False, coro cancelled)."""
    task = asyncio.ensure_future(coro)
    stopper = asyncio.ensure_future(shutdown.wait())
    done, _ = await asyncio.wait({task, stopper}, return_when=asyncio.FIRST_COMPLETED)
    for t in (task, stopper):
        if t not in done:
            t.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
    if task in done:
        task.result()
        return True
    return False


def _install_signals(shutdown: asyncio.Event) -> None:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, shutdown.set)


async def lead(settings: OperatorSettings, client: KubeClient, creds: Credentials, elector: LeaseElector,
               shutdown: asyncio.Event) -> None:
    """One leadership term: controller + kopf until the Lease is lost or shutdown is requested."""
    logger.info("leading identity=%s", elector.identity)
    controller = Controller(client, settings, fence=elector.is_leader)
    # Everything of ours is created BEFORE kopf: kopf's run_tasks cancels any task created after it started.
    controller.start()
    hold = asyncio.create_task(elector.hold(), name="lease renewal")
    stopper = asyncio.create_task(shutdown.wait(), name="shutdown waiter")
    kopf_settings = kopf.OperatorSettings()
    kopf_settings.posting.enabled = False  # we post our own Events
    kopf_settings.peering.standalone = True  # the Lease decides who runs; kopf's peering would only pause
    kopf_settings.scanning.disabled = True  # no cluster-wide CRD/namespace watches (RBAC stays narrow)
    kopf_settings.process.ultimate_exiting_timeout = None
    kopf_settings.watching.server_timeout = 300
    kopf_settings.watching.client_timeout = 330
    kopf_settings.watching.connect_timeout = 10
    kopf_settings.networking.request_timeout = 30
    kopf_settings.batching.batch_window = 0.05
    stop_flag = asyncio.Event()
    existing = {t for t in asyncio.all_tasks()}
    kopf_tasks = await kopf.spawn_tasks(
        registry=controller.registry(creds), settings=kopf_settings, stop_flag=stop_flag,
        clusterwide=settings.clusterwide, namespaces=list(settings.namespaces),
        standalone=True,
    )
    _install_signals(shutdown)  # kopf replaced our handlers with its own; ours decide
    runner = asyncio.create_task(kopf.run_tasks(kopf_tasks, ignored=existing), name="kopf")
    try:
        done, _ = await asyncio.wait({hold, stopper, runner}, return_when=asyncio.FIRST_COMPLETED)
        if hold in done:
            logger.warning("leadership lost: stopping reconciles identity=%s", elector.identity)
        elif runner in done:
            exc = runner.exception() if not runner.cancelled() else None
            logger.error("kopf stopped unexpectedly error=%r; ending this term", exc)
    finally:
        stop_flag.set()
        await controller.stop()
        try:
            await asyncio.wait_for(asyncio.shield(runner), timeout=KOPF_STOP_TIMEOUT)
        except (TimeoutError, asyncio.CancelledError, Exception):
            runner.cancel()
            with contextlib.suppress(BaseException):
                await runner
        for t in (hold, stopper):
            t.cancel()
            with contextlib.suppress(BaseException):
                await t
    logger.info("term ended identity=%s", elector.identity)
