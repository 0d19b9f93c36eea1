"""The agent's store server: one listening socket and the pieces that serve the pool, started and stopped together.

The concerns live in their own modules: ``serving`` (the handshake, the
handler table and the request handlers), ``peers`` (membership and
heartbeats), ``handoff`` (admission of writes and leaving without losing
blocks), ``pullthrough`` (a key's home fetching what it misses) and
``records`` (local-first writes recorded at their home). ``StoreServer`` wires
them to one ``BlockStore`` and owns their threads.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import socket
import ssl
import threading
from typing import Any

from daybreak.agent.store.engine import BlockStore
from daybreak.agent.store.handoff import HandOff
from daybreak.agent.store.peers import Membership
from daybreak.agent.store.pullthrough import PullThrough
from daybreak.agent.store.records import Records
from daybreak.agent.store.serving import Limits, Service, Welcome
from daybreak.pool import protocol as p
from daybreak.pool.connection import parse_address
from daybreak.pool.credentials import agent_credential
from daybreak.pool.shm import ShmSegment

log = logging.getLogger(__name__)


class StoreServer:
    """Serves one BlockStore on ``listen`` for the pool whose secret is ``token``.

    Clients prove a credential derived from it (``pool/credentials.py``); this agent talks to its
    peers with the agent credential, never with the secret itself.
    """

    def __init__(self, store: BlockStore, *, listen: str, token: bytes, pool: str, advertise: str = "",
                 peers: list[str] | None = None, replicas: int = 1, lease_seconds: int = 10,
                 limits: Limits | None = None, tls: ssl.SSLContext | None = None,
                 peer_tls: ssl.SSLContext | None = None, datapath: Any = None, offer_shm: bool = True) -> None:
        self.store = store
        self.pool = pool
        host, port = parse_address(listen)
        self.sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.sock.listen(128)
        bound_port = self.sock.getsockname()[1]
        self.address = advertise or f"{host if host not in ('0.0.0.0', '::') else socket.gethostname()}:{bound_port}"
        self.agent_id = self.address
        self.membership = Membership(address=self.address, token=agent_credential(token).encode(), peers=peers,
                                     tls=peer_tls)
        # A segment holding a nonce: a client that can map it shares this node's /dev/shm.
        nonce = secrets.token_bytes(16)
        self.probe = ShmSegment.create(f"{store.shm_prefix}-probe", 4096, exist_ok=True)
        self.probe.buffer[:16] = nonce
        self.records = Records(store=store, membership=self.membership)
        self.handoff = HandOff(store=store, membership=self.membership, replicas=replicas,
                               lease_seconds=lease_seconds)
        self.pull = PullThrough(store=store, membership=self.membership, records=self.records)
        self.service = Service(store=store, secret=token, membership=self.membership, handoff=self.handoff,
                               records=self.records, pull=self.pull, limits=limits, tls=tls,
                               # Without shm allowed (the pool's transports) no client is told the probe,
                               # so none maps the DRAM tier: same-node clients use the stream.
                               welcome=Welcome(pool=pool, shm_probe=self.probe.name if offer_shm else "",
                                               shm_nonce=nonce if offer_shm else b"",
                                               lease_seconds=lease_seconds, replicas=replicas))
        self.datapath = datapath  # agent.store.datapath.StoreDataPath: the engine's control ops
        if datapath is not None:
            self.service.handlers.update(datapath.handlers(self.service))
        self._closed = self.service.closed
        self._threads: list[threading.Thread] = []

    @property
    def leaving(self) -> bool:
        return self.membership.leaving

    # -- lifecycle ------------------------------------------------------------------------------

    def start(self) -> None:
        loops = ((lambda: self.service.accept_loop(self.sock), "store-accept"),
                 (lambda: self.membership.heartbeat_loop(self._closed), "store-heartbeat"),
                 (self._maintenance_loop, "store-maintenance"), (self.store.prefault, "store-prefault"),
                 (lambda: self.records.run(self._closed), "store-record"))
        for target, name in loops:
            t = threading.Thread(target=target, name=name, daemon=True)
            t.start()
            self._threads.append(t)
        if self.membership.known():
            self.membership.heartbeat_once()

    def close(self) -> None:
        """Stop serving (blocks stay in /dev/shm for the next start to re-adopt)."""
        self._closed.set()
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
        self.service.shutdown_connections()
        for t in self._threads:
            t.join(timeout=5)
        self.membership.close()
        if self.datapath is not None:
            self.datapath.close()
        with contextlib.suppress(BufferError):
            self.probe.close()

    def _maintenance_loop(self) -> None:
        while not self._closed.wait(0.5):
            self.store.expire()
            self.store.maybe_compact()

    # -- the pool ---------------------------------------------------------------------------------

    def members(self) -> list[p.Member]:
        """Live, serving agents as this agent sees them (itself included unless leaving)."""
        return self.membership.members()

    def set_peers(self, addresses: list[str]) -> None:
        """Replace the peer list (in a cluster: the pool's published endpoints); new ones are pinged next tick."""
        self.membership.set_peers(addresses)

    def leave(self) -> int:
        """Hand every block to its new homes among the remaining agents; returns blocks moved."""
        return self.handoff.leave()
