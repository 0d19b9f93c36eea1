"""``daybreak agent``: the node agent process; ``--standalone`` serves a store pool without Kubernetes.

Standalone: ``daybreak agent --standalone --listen ADDR:P --dram 2Gi [--ssd-path DIR --ssd 8Gi]
[--peers ADDR:P,...] [--replicas R] --token-file F`` serves this node's tier of a pool whose
agents share the pool secret in F (written fresh, mode 0600, when F does not exist) and logs one
line containing ``ready`` once it accepts requests. SIGTERM or SIGINT make it hand its blocks to
the other agents first, then exit and remove its DRAM tier from /dev/shm and its SSD directory
(``--keep-segments`` leaves both for the next start to re-adopt; a crash leaves them too, and tiers
nobody re-adopts within ``orphan_seconds`` are removed by the next agent that starts).

In a cluster the same store runs next to the node's discovery and publishing
(``daybreak.agent.node``), configured from the environment the DaemonSet sets.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import re
import secrets
import signal
import sys
import threading
from pathlib import Path
from typing import Any

from daybreak.agent.settings import AgentSettings
from daybreak.api.metrics import STORE_BYTES, total
from daybreak.logs import setup_logging

log = logging.getLogger(__name__)

_SIZES = {"": 1, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12,
          "Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40}


def parse_size(text: str, *, flag: str) -> int:
    """``2Gi`` -> bytes, through the API's quantity parser when present; errors name the flag."""
    parse_bytes: Any = None
    with contextlib.suppress(ImportError):  # the API package normally ships with the agent
        from daybreak.api.quantity import parse_bytes
    if parse_bytes is not None:
        try:
            return int(parse_bytes(text))
        except ValueError as exc:
            raise ValueError(f"{flag}: {exc}") from None
    m = re.fullmatch(r"(\d+)\s*([kMGT]i?)?", text.strip())
    if not m:
        raise ValueError(f"{flag}: {text!r} is not a byte size (examples: 2Gi, 512Mi, 1073741824)")
    return int(m.group(1)) * _SIZES[m.group(2) or ""]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--standalone", action="store_true", help="serve a store pool without Kubernetes")
    parser.add_argument("--config", help="YAML/JSON settings file (flags and DAYBREAK_* variables win)")
    parser.add_argument("--listen", help="ADDR:PORT to serve on (default 127.0.0.1:7480)")
    parser.add_argument("--advertise", help="ADDR:PORT peers and clients use to reach this agent")
    parser.add_argument("--dram", help="DRAM tier size, e.g. 2Gi")
    parser.add_argument("--ssd-path", help="directory for the SSD tier")
    parser.add_argument("--ssd", help="SSD tier size, e.g. 8Gi (needs --ssd-path)")
    parser.add_argument("--hbm", help="HBM tier size on every accelerator device, e.g. 4Gi (needs an accelerator "
                        "runtime)")
    parser.add_argument("--peers", help="comma-separated ADDR:PORT of the other agents of the pool")
    parser.add_argument("--replicas", type=int, help="copies of each block")
    parser.add_argument("--token-file", help="file holding the pool token (created when missing)")
    parser.add_argument("--pool", help="pool name (names the shared-memory segments)")
    parser.add_argument("--eviction", choices=["lru", "s3fifo"], help="eviction policy (default s3fifo)")
    parser.add_argument("--high-watermark", type=float, help="fill fraction at which eviction starts")
    parser.add_argument("--low-watermark", type=float, help="fill fraction eviction frees down to")
    parser.add_argument("--lease-seconds", type=int, help="how long a reader's lease protects a block")
    parser.add_argument("--metrics-port", type=int, help="serve Prometheus /metrics on this port (bound to the "
                        "--listen address)")
    parser.add_argument("--tls-cert", help="PEM certificate: serve the store protocol over TLS")
    parser.add_argument("--tls-key", help="PEM private key of --tls-cert")
    parser.add_argument("--tls-ca", help="PEM CA bundle the agent checks its peers against (with --tls-cert)")
    parser.add_argument("--keep-segments", action="store_true", default=None,
                        help="standalone: keep the DRAM tier in /dev/shm and the SSD directory after a clean stop")
    parser.add_argument("--handshake-seconds", type=float, help="deadline of a connection's whole handshake")
    parser.add_argument("--idle-seconds", type=float, help="close authenticated connections idle this long")
    parser.add_argument("--io-seconds", type=float, help="deadline of a request's body or reply")
    parser.add_argument("--max-connections", type=int, help="connections per tcp server (store, transfer engine)")
    parser.add_argument("--max-connections-per-address", type=int, help="connections per client address, per tcp server")
    parser.add_argument("--max-connections-per-credential", type=int,
                        help="authenticated store connections per namespace credential")
    parser.add_argument("--namespace-held-fraction", type=float,
                        help="fraction of a tier one kvNamespace may hold under leases and reservations")
    parser.add_argument("--namespace-pinned-fraction", type=float,
                        help="fraction of a tier one kvNamespace may hold pinned")
    parser.add_argument("--max-pin-seconds", type=int, help="longest soft pin a writer may ask for")
    parser.add_argument("--orphan-seconds", type=float, help="remove ownerless /dev/shm tiers and SSD directories "
                        "idle this long")
    parser.add_argument("--transports", help="comma-separated transports this agent may use, most preferred first "
                        "(rdma,link,shm,tcp; default all)")
    parser.add_argument("--log-level", default=os.environ.get("DAYBREAK_LOG_LEVEL", "INFO"))


def settings_from(args: argparse.Namespace) -> AgentSettings:
    sizes = {name: parse_size(getattr(args, attr), flag=flag)
             for name, attr, flag in (("dram_bytes", "dram", "--dram"), ("ssd_bytes", "ssd", "--ssd"),
                                      ("hbm_bytes", "hbm", "--hbm"))
             if getattr(args, attr) is not None}
    overrides: dict[str, Any] = {
        "standalone": True if args.standalone else None,
        "listen": args.listen, "advertise": args.advertise, "ssd_path": args.ssd_path,
        "peers": [p for p in args.peers.split(",") if p] if args.peers is not None else None,
        "replicas": args.replicas, "token_file": args.token_file, "pool_name": args.pool,
        "eviction_policy": args.eviction, "high_watermark": args.high_watermark,
        "low_watermark": args.low_watermark, "lease_seconds": args.lease_seconds,
        "metrics_port": args.metrics_port, "keep_segments": args.keep_segments,
        "tls_cert_file": args.tls_cert, "tls_key_file": args.tls_key, "tls_ca_file": args.tls_ca,
        "handshake_seconds": args.handshake_seconds, "idle_seconds": args.idle_seconds,
        "io_seconds": args.io_seconds, "max_connections": args.max_connections,
        "max_connections_per_address": args.max_connections_per_address, "orphan_seconds": args.orphan_seconds,
        "max_connections_per_credential": args.max_connections_per_credential,
        "namespace_held_fraction": args.namespace_held_fraction,
        "namespace_pinned_fraction": args.namespace_pinned_fraction, "max_pin_seconds": args.max_pin_seconds,
        "transports": [t for t in args.transports.split(",") if t] if args.transports is not None else None,
        **sizes,
    }
    settings = AgentSettings.load(config_file=args.config, overrides=overrides)
    if settings.ssd_bytes and not settings.ssd_path:
        raise ValueError("--ssd: needs --ssd-path (the directory for the SSD tier)")
    if bool(settings.tls_cert_file) != bool(settings.tls_key_file):
        raise ValueError("--tls-cert and --tls-key: give both (or neither)")
    if settings.standalone and not settings.token_file:
        raise ValueError("--token-file: required with --standalone (agents of one pool share it)")
    return settings


def load_token(path: str) -> bytes:
    """Read the pool secret, or write a fresh one (0600) atomically when the file does not exist yet.

    Refused: a secret shorter than ``MIN_SECRET_CHARS`` and a file others may write (either lets
    someone else into the pool).
    """
    from daybreak.pool.credentials import MIN_SECRET_CHARS

    file = Path(path)
    try:
        fd = os.open(file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        pass
    else:
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32) + "\n")
        log.info("event=token_created path=%s", file)
    mode = file.stat().st_mode
    if mode & 0o022:
        raise ValueError(f"--token-file: {file} is writable by others (mode {oct(mode & 0o777)}); "
                         f"chmod 600 it, or anyone on the host can replace the pool secret")
    token = file.read_text().strip()
    if not token:
        raise ValueError(f"--token-file: {file} is empty")
    if len(token) < MIN_SECRET_CHARS:
        raise ValueError(f"--token-file: the pool secret in {file} has {len(token)} characters, fewer than "
                         f"{MIN_SECRET_CHARS}; remove the file to have a fresh one written")
    return token.encode()


def build_store(settings: AgentSettings, *, token: bytes) -> Any:
    """The node's BlockStore and its StoreServer, not yet started."""
    from daybreak.agent.store.engine import BlockStore, Quotas, StoreConfig
    from daybreak.agent.store.server import StoreServer
    from daybreak.agent.store.serving import Limits
    from daybreak.agent.store.tiers import (
        HbmTier,
        SsdOwner,
        reclaim_orphans,
        reclaim_ssd_orphans,
        slug,
        ssd_directory,
    )

    pool = settings.pool_name or "standalone"
    hbm = None
    runtime = None
    if settings.hbm_bytes:
        from daybreak.agent.runtime import load_runtime

        loaded = load_runtime(settings.runtime, sunrise_lib_dir=settings.sunrise_lib_dir)
        if loaded.runtime.devices():
            runtime = loaded.runtime
            # hbm_bytes on every device the runtime reports (KVPool spec.tiers.hbm.bytesPerDevice).
            hbm = HbmTier(runtime=loaded.runtime, devices=[d.index for d in loaded.runtime.devices()],
                          capacity=settings.hbm_bytes)
            log.info("event=hbm_tier devices=%s bytes_per_device=%d bytes=%d",
                     ",".join(str(d) for d in hbm.devices), hbm.per_device, hbm.capacity)
        else:
            log.warning("event=hbm_disabled reason=%r", "no accelerator runtime loaded: " +
                        "; ".join(f"{k}: {v}" for k, v in loaded.skipped.items()))
    address = settings.advertise or settings.listen
    prefix = f"daybreak-{slug(pool)}-{slug(address)}"
    reclaim_orphans(older_than_seconds=settings.orphan_seconds, keep=prefix)
    ssd_owner, ssd_dir = None, None
    if settings.ssd_path and settings.ssd_bytes:
        # The SSD tier's own directory and key: another pool on this root (another secret, or this name with
        # another uid) never shares it, and the sweep removes the directories nobody will re-adopt.
        ssd_owner = SsdOwner.for_pool(secret=token, namespace=settings.pool_namespace, name=pool,
                                      uid=settings.pool_uid)
        ssd_dir = ssd_directory(root=Path(settings.ssd_path), owner=ssd_owner, agent=address)
        reclaim_ssd_orphans(root=Path(settings.ssd_path), owner=ssd_owner, keep=ssd_dir,
                            older_than_seconds=settings.orphan_seconds)
    store = BlockStore(StoreConfig(
        prefix=prefix, dram_bytes=settings.dram_bytes, ssd_path=str(ssd_dir or ""), ssd_owner=ssd_owner,
        ssd_bytes=settings.ssd_bytes, policy=settings.eviction_policy, high_watermark=settings.high_watermark,
        low_watermark=settings.low_watermark, lease_seconds=settings.lease_seconds, hbm=hbm,
        quotas=Quotas(held_fraction=settings.namespace_held_fraction,
                      pinned_fraction=settings.namespace_pinned_fraction, max_pin_seconds=settings.max_pin_seconds)))
    store.open()
    datapath = start_datapath(settings, store=store, token=token, runtime=runtime) if settings.store_transfer else None
    tls = settings.tls()  # one cert for both tcp paths: the store's listener and the transfer engine's
    server = StoreServer(store, listen=settings.listen, token=token, pool=pool, advertise=settings.advertise,
                         peers=settings.peers, replicas=settings.replicas, lease_seconds=settings.lease_seconds,
                         limits=Limits(handshake_seconds=settings.handshake_seconds, idle_seconds=settings.idle_seconds,
                                       io_seconds=settings.io_seconds, max_connections=settings.max_connections,
                                       max_connections_per_address=settings.max_connections_per_address,
                                       max_connections_per_credential=settings.max_connections_per_credential),
                         tls=tls.server if tls else None,
                         peer_tls=tls.client if tls else None, datapath=datapath,
                         offer_shm="shm" in settings.transports)
    return server


def start_datapath(settings: AgentSettings, *, store: Any, token: bytes, runtime: Any = None,
                   verbs: Any = None) -> Any:
    """Start the transfer engine from the settings, register the store's segments, run the preflight."""
    from daybreak.agent.preflight import Preflight
    from daybreak.agent.store.datapath import StoreDataPath
    from daybreak.agent.transfer.config import EngineConfig
    from daybreak.agent.transfer.engine import TransferEngine

    config = EngineConfig.for_agent(settings, token=token.decode())
    engine = TransferEngine.from_config(config, runtime=runtime, verbs=verbs).start()
    datapath = StoreDataPath(store=store, engine=engine, own_engine=True)
    datapath.register()
    datapath.preflight = Preflight(engine=engine, runtime=runtime).run()
    return datapath


class AgentRegistry:
    """What the agent's /metrics serves: its store's own registry plus the process-wide one.

    The store keeps a registry of its own (several stores share a test process); the transfer engine's
    counters (fallbacks, tripped paths, bytes per transport) and the process metrics live in the
    process-wide registry, and an agent runs one engine, so serving both loses nothing and mixes nothing.
    """

    def __init__(self, store_registry: Any) -> None:
        self._store = store_registry

    def collect(self) -> Any:
        from prometheus_client import REGISTRY

        yield from self._store.collect()
        yield from REGISTRY.collect()


def start_store(settings: AgentSettings) -> Any:
    """Open the tiers, start serving and log ``ready``; returns the running StoreServer."""
    from daybreak.pool.connection import parse_address
    from daybreak.pool.shm import share_with_group

    share_with_group(settings.shm_group_access)
    token = load_token(settings.token_file)
    server = build_store(settings, token=token)
    if settings.metrics_port:
        from prometheus_client import start_http_server

        # On the store's own address: agents of several fake nodes share one host (the local cluster), and
        # --listen 127.0.0.1 keeps /metrics off the network too.
        start_http_server(settings.metrics_port, addr=parse_address(settings.listen)[0],
                          registry=AgentRegistry(server.store.metrics.registry))
    server.start()
    stats = server.store.stats()
    log.info("event=ready agent=%s pool=%s blocks=%d dram_bytes=%d peers=%d", server.agent_id, server.pool,
             stats["blocks"], stats["dram_capacity"], len(settings.peers))
    return server


def stop_store(server: Any, *, remove: bool = False) -> None:
    """Hand blocks to the other agents, then close; ``remove`` also deletes the DRAM tier and the SSD directory.

    Kept (``remove=False``) for a restart or an upgrade to re-adopt; removed when nobody will.
    """
    log.info("event=stopping agent=%s", server.agent_id)
    try:
        server.leave()
    finally:
        server.close()
        server.store.close(unlink=remove or getattr(server, "flush_on_stop", False))
    log.info("event=stopped agent=%s", server.agent_id)


STOP_DECISION_SECONDS = 10.0  # of the pod's 60 s grace period: the hand-off to other agents needs the rest


def stop_pool_store(settings: AgentSettings, server: Any) -> None:
    """Pool mode's SIGTERM: keep the tier for re-adoption only when the pool still selects this node.

    The pool watch may already have seen the KVPool deleted (``flush_on_stop``); otherwise the API decides
    (``agent.flush.pool_keeps_node``). When it cannot be asked, the tier is kept: a later agent on this
    node re-adopts it or reclaims it as an orphan (``orphan_seconds``), while removing it could lose a
    restart's blocks.
    """
    remove = bool(getattr(server, "flush_on_stop", False))
    reason = "pool_deleted" if remove else ""
    if not remove and settings.pool_name and settings.pool_namespace and settings.node_name:
        from daybreak.agent.flush import readopted_after_stop
        from daybreak.agent.publish import load_client

        async def ask() -> tuple[bool, str]:
            api = await load_client(settings.kubeconfig)
            try:
                return await asyncio.wait_for(readopted_after_stop(
                    api, namespace=settings.pool_namespace, pool=settings.pool_name, node=settings.node_name),
                    timeout=STOP_DECISION_SECONDS)
            finally:
                await api.close()

        try:
            keep, reason = asyncio.run(ask())
            remove = not keep
        except Exception as exc:  # the API down or refusing: keeping is the recoverable choice
            reason = f"api_unavailable:{type(exc).__name__}"
            log.warning("event=stop_decision_failed agent=%s error=%r action=keep_tier", server.agent_id, str(exc))
    log.info("event=stop_decision agent=%s node=%s pool=%s/%s tier=%s reason=%s", server.agent_id,
             settings.node_name or "-", settings.pool_namespace, settings.pool_name,
             "remove" if remove else "keep", reason or "no_pool_or_node_name")
    stop_store(server, remove=remove)


def serve_store(settings: AgentSettings, *, stop: threading.Event) -> int:
    """Standalone: run the store until ``stop`` is set."""
    server = start_store(settings)
    stop.wait()
    stop_store(server, remove=not settings.keep_segments)
    return 0


def _store_hooks(server: Any) -> dict[str, Any]:
    """What the node side publishes about the store: its DRAM segments (for RDMA registration) and tier use."""
    from daybreak.agent.registration import host_segment

    store = server.store

    def segments() -> list[Any]:
        return [host_segment(seg.name, seg.buffer) for seg in store.shm_segments()]

    hooks: dict[str, Any] = {"store_segments": segments, "tier_usage": store.usage,
                             # what the tiers really allocated (HBM: per device, summed), not settings x devices
                             "tier_capacity": lambda: {name: tier.capacity for name, tier in store.tiers.items()}}
    ledger = getattr(server, "flush_ledger", None)
    if ledger is not None:  # what this agent freed for its KVPool's status.flushRequests, for KVNode
        hooks["namespace_flushes"] = ledger.reports
    datapath = getattr(server, "datapath", None)
    if datapath is not None:  # per-transport conditions and the engine's segments, for KVNode
        hooks["transfer_state"] = lambda: (_with_store_bytes(datapath.preflight.conditions(), store.metrics),
                                           datapath.descriptors())
    return hooks


def _with_store_bytes(conditions: list[dict[str, Any]], metrics: Any) -> list[dict[str, Any]]:
    """Each engine transport's condition plus the block bytes the store itself moved over it (``storeBytes``).

    The store's own paths are the same-node memcpy (shm) and its stream (tcp; tls counts as tcp here):
    KVNode then shows every byte the agent moved per transport, not only the engine's one-sided ones.
    """
    def moved(label: str) -> int:
        return int(sum(metrics.registry.get_sample_value(total(STORE_BYTES),
                                                         {"transport": label, "op": op}) or 0
                       for op in ("read", "write")))

    out = []
    for condition in conditions:
        labels = ("tcp", "tls") if condition["transport"] == "tcp" else (condition["transport"],)
        out.append({**condition, "storeBytes": sum(moved(label) for label in labels)})
    return out


async def _follow_members(settings: AgentSettings, server: Any, stop: asyncio.Event) -> None:
    """Keep the store's peer list equal to the endpoints the operator publishes on our KVPool."""
    from daybreak.agent.flush import flush_requests
    from daybreak.agent.membership import follow_pool_endpoints
    from daybreak.agent.publish import load_client

    ledger = getattr(server, "flush_ledger", None)

    def on_pool(obj: dict[str, Any]) -> None:
        if ledger is not None:  # the operator's flush requests: this agent flushes its own store, in-process
            ledger.apply(flush_requests(obj))

    api = await load_client(settings.kubeconfig)
    try:
        await follow_pool_endpoints(api, namespace=settings.pool_namespace, pool=settings.pool_name,
                                    on_change=server.set_peers, stop=stop, on_pool=on_pool,
                                    on_deleted=lambda: setattr(server, "flush_on_stop", True))
    finally:
        await api.close()


async def _mint_credentials(settings: AgentSettings, stop: asyncio.Event) -> None:
    """Create the namespace-credential Secrets of the pool's PDDeployments (``daybreak.agent.credentials_minter``)."""
    from daybreak.agent.credentials_minter import mint_pool_credentials
    from daybreak.agent.publish import load_client

    api = await load_client(settings.kubeconfig)
    try:
        await mint_pool_credentials(api, namespace=settings.pool_namespace, pool=settings.pool_name,
                                    pool_secret=load_token(settings.token_file), stop=stop)
    finally:
        await api.close()


def _run_node(settings: AgentSettings, stop: threading.Event, server: Any) -> int:
    """Cluster mode: discovery, registration and publishing (``daybreak.agent.node``) until ``stop``."""
    try:
        from daybreak.agent.node import run_node_agent
    except ModuleNotFoundError as exc:
        if exc.name != "daybreak.agent.node":
            raise
        log.error("event=node_mode_unavailable reason=%r", "daybreak.agent.node is not part of this build")
        return 2

    async def _main() -> None:
        loop = asyncio.get_running_loop()
        done = asyncio.Event()
        # SIGTERM sets the threading event (see run); mirror it into the node's asyncio event
        # from a daemon thread (an executor thread would hold asyncio.run's shutdown).
        def bridge() -> None:
            stop.wait()
            with contextlib.suppress(RuntimeError):  # the loop may be gone already
                loop.call_soon_threadsafe(done.set)

        threading.Thread(target=bridge, daemon=True, name="stop-bridge").start()
        if server is not None:
            from daybreak.agent.flush import FlushLedger

            server.flush_ledger = FlushLedger(server.service.flush_namespace)
        kwargs = _store_hooks(server) if server is not None else {}
        side: list[asyncio.Task[None]] = []
        if server is not None and settings.pool_name and settings.pool_namespace:
            side.append(asyncio.create_task(_follow_members(settings, server, done), name="daybreak-pool-members"))
            side.append(asyncio.create_task(_mint_credentials(settings, done), name="daybreak-credential-minter"))
        try:
            await run_node_agent(settings, stop=done, **kwargs)
        finally:
            done.set()
            await asyncio.gather(*side, return_exceptions=True)

    try:
        asyncio.run(_main())
    except ValueError as exc:  # settings the node side cannot run with, named by field
        log.error("event=node_mode_failed reason=%r", str(exc))
        return 2
    finally:
        stop.set()
    return 0


def run(args: argparse.Namespace) -> int:
    setup_logging(args.log_level)
    try:
        settings = settings_from(args)
    except ValueError as exc:
        print(f"daybreak agent: {exc}", file=sys.stderr)
        return 2
    log.info("event=settings %s", settings.describe())
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    if settings.standalone:
        return serve_store(settings, stop=stop)
    # In a cluster the store serves the pool this node belongs to, next to the node side.
    server = start_store(settings) if settings.token_file and settings.pool_name else None
    try:
        return _run_node(settings, stop, server)
    finally:
        if server is not None:
            stop_pool_store(settings, server)
