"""The transfer engine's settings as one typed object, and how an agent's or an engine pod's settings become it.

``EngineConfig`` is the one way to configure a ``TransferEngine`` from a process's settings
(``TransferEngine.from_config``): the agent builds it from its ``api.agentconfig.AgentConfig``
(``for_agent``), an engine pod from the operator's engine-pod contract ``api.enginepod.EnginePodEnv``
(``for_engine_pod``, which ``daybreak.client.datapath.engine_for_pod`` calls). Both read only ``api/``
models, so this module, like the rest of ``agent/transfer/``, imports nothing else of the agent.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from daybreak.agent.transfer.registry import TRANSPORTS
from daybreak.api.agentconfig import AgentConfig
from daybreak.api.enginepod import EnginePodEnv
from daybreak.pool.admission import Caps
from daybreak.pool.tls import TlsContexts, client_context, contexts

DEFAULT_TIMEOUT_S = 30.0  # a batch's deadline when the caller gives none, in seconds


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """Everything a ``TransferEngine`` is configured with but its hardware handles (runtime, topology, verbs).

    The fields and defaults are ``TransferEngine``'s keyword arguments (see its docstring); the defaults
    are an engine private to one process: loopback tcp on a free port, every transport, no credential.
    """

    node: str | None = None  # None: the host name (shm and link need the agent's node name to match)
    listen: str = "127.0.0.1:0"  # loopback: nobody but this host dials an engine it did not advertise
    advertise: str | None = None
    transports: tuple[str, ...] = TRANSPORTS
    tcp_connections: int = 2
    slice_bytes: int = 4 << 20
    checksum: bool = False
    token: str = field(default="", repr=False)  # a credential: never in a log line
    timeout_s: float = DEFAULT_TIMEOUT_S
    rdma_nics: tuple[str, ...] = ()  # empty: the topology's, else every device found
    tls: TlsContexts | None = None
    caps: Caps = field(default_factory=Caps)
    idle_seconds: float = 300.0

    def as_kwargs(self) -> dict[str, object]:
        """The fields as ``TransferEngine`` keyword arguments (shallow: the TLS contexts are shared)."""
        values: dict[str, object] = {f.name: getattr(self, f.name) for f in fields(self)}
        values["rdma_nics"] = list(self.rdma_nics) or None
        return values

    @classmethod
    def for_agent(cls, settings: AgentConfig, *, token: str) -> EngineConfig:
        """An agent's engine: its ``transfer_*`` settings, ``node_name``, ``rdma_devices``, ``transports`` (the pool's
        ``spec.transport.preference`` as the operator renders it), the store's TLS and connection caps.

        An agent's engine serves tcp to the pod network, so it always checks a credential (``token``, the pool
        secret) and binds no wider than the store (``transfer_listen`` empty: the store's host, a free port).
        """
        if not token:
            raise ValueError("the agent's transfer engine needs the pool secret as its token (an engine without one "
                             "would accept any peer); pass token=")
        listen = settings.transfer_listen
        if not listen:
            host = settings.listen.rpartition(":")[0] or "127.0.0.1"
            listen = f"{host}:0"
        return cls(node=settings.node_name or None, listen=listen, transports=tuple(settings.transports),
                   advertise=settings.transfer_advertise or None, tcp_connections=settings.transfer_connections,
                   slice_bytes=settings.transfer_slice_bytes, checksum=settings.transfer_checksum, token=token,
                   timeout_s=settings.transfer_timeout_seconds, rdma_nics=tuple(settings.rdma_devices),
                   tls=contexts(cert_file=settings.tls_cert_file, key_file=settings.tls_key_file,
                                ca_file=settings.tls_ca_file),
                   caps=Caps(max_connections=settings.max_connections,
                             max_connections_per_address=settings.max_connections_per_address),
                   idle_seconds=settings.idle_seconds)

    @classmethod
    def for_engine_pod(cls, pod: EnginePodEnv, *, token: str, node: str | None = None) -> EngineConfig:
        """An engine pod's engine: the pool's transports (``DAYBREAK_TRANSPORTS``; empty: all), the credential the
        pod reads its agents with (``token``), and TLS toward the agents when the pool has it
        (``DAYBREAK_POOL_TLS_CA_FILE``). ``node`` is the pod's node name (the downward API's ``spec.nodeName``):
        shm and link reach only an agent whose descriptors name the same node.

        The engine listens on loopback only: agents never dial an engine pod (the client's transfers are one-sided
        from its side), and it serves no TLS (it has no certificate; ``TlsContexts.server`` is None).
        """
        if not token:
            raise ValueError("an engine pod's transfer engine needs the pool credential as its token (the agents "
                             "refuse an engine without one); give DAYBREAK_POOL_TOKEN or DAYBREAK_POOL_TOKEN_FILE")
        tls = (TlsContexts(server=None, client=client_context(ca_file=pod.pool_tls_ca_file))
               if pod.pool_tls_ca_file else None)
        return cls(node=node or None, transports=tuple(pod.transports) or TRANSPORTS, token=token, tls=tls)

