"""The transport registry: which transports exist, in what order they start, and how each one is opened.

The engine asks ``open_transports`` for the ones a caller wanted and gets back
those that came up: rdma enables itself only when pyverbs and an ACTIVE NIC
are present and link only with an accelerator runtime that has devices; each
one that stays off logs why and the chains fall back (rdma -> tcp, link ->
shm -> tcp).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from daybreak.agent.transfer.transport import Transport, TransportHost

log = logging.getLogger(__name__)

# Every transport name, in the order the engine documents them; see ``_FACTORIES`` for start order.
TRANSPORTS = ("link", "rdma", "shm", "tcp")


@dataclass(frozen=True)
class TransportConfig:
    """What the transports are opened with (the engine's keyword arguments of the same names)."""

    listen: str = "127.0.0.1:0"
    advertise: str | None = None
    tcp_connections: int = 2
    slice_bytes: int = 4 << 20
    checksum: bool = False
    verbs: Any = None
    runtime: Any = None
    rdma_nics: Sequence[str] | None = None
    topology: Any = None
    tls: Any = None  # pool.tls.TlsContexts: tcp serves and dials TLS only
    caps: Any = None  # pool.admission.Caps of the tcp server (None: its defaults)
    idle_seconds: float = 300.0  # the tcp server closes an authenticated connection idle this long


def _shm(host: TransportHost, config: TransportConfig) -> Transport | None:
    from daybreak.agent.transfer.shm import ShmTransport

    return ShmTransport(host)


def _tcp(host: TransportHost, config: TransportConfig) -> Transport | None:
    from daybreak.agent.transfer.tcp import TcpTransport

    return TcpTransport(host, listen=config.listen, advertise=config.advertise, connections=config.tcp_connections,
                        slice_bytes=config.slice_bytes, checksum=config.checksum, tls=config.tls, caps=config.caps,
                        idle_seconds=config.idle_seconds)


def _rdma(host: TransportHost, config: TransportConfig) -> Transport | None:
    from daybreak.agent.runtime.verbs import RdmaUnavailable
    from daybreak.agent.transfer.rdma import RdmaTransport

    try:
        return RdmaTransport(host, verbs=config.verbs, topology=config.topology, runtime=config.runtime,
                             nics=list(config.rdma_nics) if config.rdma_nics else None)
    except RdmaUnavailable as exc:
        log.info("transfer rdma disabled engine=%s cause=%r fallback=tcp", host.engine_id, str(exc))
        return None


def _link(host: TransportHost, config: TransportConfig) -> Transport | None:
    runtime = config.runtime
    if runtime is None or not getattr(runtime, "devices", lambda: ())():
        log.info("transfer link disabled engine=%s cause='no accelerator runtime with devices' fallback=shm,tcp",
                 host.engine_id)
        return None
    from daybreak.agent.transfer.link import LinkTransport

    return LinkTransport(host, runtime)


# Start order: tcp before rdma, whose queue-pair set-up rides on the tcp server.
_FACTORIES: dict[str, Callable[[TransportHost, TransportConfig], Transport | None]] = {
    "shm": _shm, "tcp": _tcp, "rdma": _rdma, "link": _link,
}


def check_names(wanted: Sequence[str]) -> None:
    """ValueError naming the unknown transports in ``wanted``."""
    unknown = [t for t in wanted if t not in TRANSPORTS]
    if unknown:
        raise ValueError(f"transports: unknown {unknown}, expected a subset of {list(TRANSPORTS)}")


def open_transports(host: TransportHost, wanted: Sequence[str], config: TransportConfig) -> dict[str, Transport]:
    """Open each wanted transport that can run here, in start order; name -> transport."""
    check_names(wanted)
    opened: dict[str, Transport] = {}
    for name, factory in _FACTORIES.items():
        if name in wanted:
            transport = factory(host, config)
            if transport is not None:
                opened[name] = transport
    return opened
