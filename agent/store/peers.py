"""Pool membership as one agent sees it: the peers it knows, their liveness, and idle connections to them.

Membership is masterless: every agent pings the peers it knows (the static
``--peers`` list, or the pool's published endpoints) every
``HEARTBEAT_SECONDS`` and learns new ones from their replies. Members come only
from authenticated sources: the configured or published list, PINGs over
connections that proved the agent credential, and replies of peers that proved
it back (the handshake is mutual); at most ``MAX_PEERS`` are known. A peer that
misses ``DEAD_AFTER_FAILURES`` heartbeats in a row is no longer live; one
that says it is leaving stays known (it still holds blocks) but is no longer
ranked for placement.
"""

from __future__ import annotations

import contextlib
import logging
import ssl
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

from daybreak.pool import protocol as p
from daybreak.pool.connection import Connection

log = logging.getLogger(__name__)

HEARTBEAT_SECONDS = 0.5
DEAD_AFTER_FAILURES = 2
# At most this many peers are known; beyond it new ones are ignored (logged), so no flood of names grows it.
MAX_PEERS = 1024
# An idle peer connection older than this is replaced before use (servers close idle ones after idle_seconds).
MAX_IDLE_SECONDS = 60.0


@dataclass
class Peer:
    address: str
    agent_id: str = ""
    live: bool = False
    leaving: bool = False
    failures: int = 0
    last_seen: float = 0.0


class PeerPool:
    """Idle connections to other agents, borrowed one request at a time."""

    def __init__(self, token: bytes, agent_id: str, tls: ssl.SSLContext | None = None) -> None:
        self.token = token
        self.agent_id = agent_id
        self.tls = tls
        self._idle: dict[str, list[tuple[Connection, float]]] = {}
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def borrow(self, address: str, *, timeout_seconds: float = 10.0) -> Iterator[Connection]:
        with self._lock:
            idle = self._idle.setdefault(address, [])
            conn, since = idle.pop() if idle else (None, 0.0)
        if conn is not None and time.monotonic() - since > MAX_IDLE_SECONDS:
            conn.close()
            conn = None
        if conn is None:
            conn = Connection(address, token=self.token, timeout_seconds=timeout_seconds, client=self.agent_id,
                              tls=self.tls)
        try:
            yield conn
        except BaseException:
            conn.close()
            raise
        with self._lock:
            self._idle.setdefault(address, []).append((conn, time.monotonic()))

    def drop(self, address: str) -> None:
        with self._lock:
            for conn, _ in self._idle.pop(address, []):
                conn.close()

    def close(self) -> None:
        with self._lock:
            for conns in self._idle.values():
                for conn, _ in conns:
                    conn.close()
            self._idle.clear()


class Membership:
    """The peers this agent knows, kept live by heartbeats; ``leaving`` is this agent's own state."""

    def __init__(self, *, address: str, token: bytes, peers: list[str] | None = None,
                 tls: ssl.SSLContext | None = None) -> None:
        self.address = address
        self.agent_id = address
        self.leaving = False
        self.conns = PeerPool(token, self.agent_id, tls)
        self._peers: dict[str, Peer] = {}
        self._lock = threading.Lock()
        for peer in peers or []:
            if peer and peer != self.address:
                self._peers[peer] = Peer(peer)

    def known(self) -> bool:
        """Whether any peer is known (the server pings them once at start)."""
        with self._lock:
            return bool(self._peers)

    def me(self) -> p.Member:
        return p.Member(self.agent_id, self.address, 1 if self.leaving else 0)

    def members(self) -> list[p.Member]:
        """Live, serving agents as this agent sees them (itself included unless leaving)."""
        out = [] if self.leaving else [self.me()]
        with self._lock:
            out += [p.Member(x.agent_id or x.address, x.address, 0) for x in self._peers.values()
                    if x.live and not x.leaving]
        return out

    def live_ids(self, *, include_self: bool = True) -> list[str]:
        return [m.agent_id for m in self.members() if include_self or m.agent_id != self.agent_id]

    def unconfirmed(self, live: list[str]) -> list[str]:
        """Known peers not in ``live``: leaving ones, and ones not yet (or no longer) answering."""
        with self._lock:
            return [x.agent_id or x.address for x in self._peers.values() if (x.agent_id or x.address) not in live]

    def address_of(self, agent_id: str) -> str:
        with self._lock:
            for x in self._peers.values():
                if (x.agent_id or x.address) == agent_id:
                    return x.address
        return agent_id

    def set_peers(self, addresses: list[str]) -> None:
        """Replace the peer list (in a cluster: the pool's published endpoints); new ones are pinged next tick."""
        wanted = {a for a in addresses if a and a != self.address}
        if len(wanted) > MAX_PEERS:
            log.warning("event=peers_truncated agent=%s given=%d kept=%d", self.agent_id, len(wanted), MAX_PEERS)
            wanted = set(sorted(wanted)[:MAX_PEERS])
        with self._lock:
            for gone in set(self._peers) - wanted:
                del self._peers[gone]
            for address in wanted - set(self._peers):
                self._peers[address] = Peer(address)

    def heard(self, member: p.Member) -> None:
        """A peer told us about itself (its PING over an agent-authenticated connection, or its reply to ours)."""
        if member.address == self.address or not member.address:
            return
        with self._lock:
            if member.address not in self._peers and len(self._peers) >= MAX_PEERS:
                log.warning("event=peer_ignored agent=%s peer=%s reason=member_bound max=%d", self.agent_id,
                            member.address[:80], MAX_PEERS)
                return
            peer = self._peers.setdefault(member.address, Peer(member.address))
            was_live = peer.live and not peer.leaving
            peer.agent_id, peer.leaving, peer.live = member.agent_id, bool(member.state), True
            peer.failures, peer.last_seen = 0, time.monotonic()
        if not was_live and not member.state:
            log.info("event=peer_joined agent=%s peer=%s", self.agent_id, member.address)

    def heartbeat_once(self) -> None:
        with self._lock:
            addresses = list(self._peers)
        for address in addresses:
            try:
                with self.conns.borrow(address, timeout_seconds=2.0) as conn:
                    view = conn.ping(self.me())
                for member in view:
                    if member.address == address or member.address not in self._peers:
                        self.heard(member)
            except Exception as exc:  # any failure counts as a missed heartbeat
                with self._lock:
                    peer = self._peers.get(address) or Peer(address)  # may have been removed meanwhile
                    peer.failures += 1
                    if peer.live and peer.failures >= DEAD_AFTER_FAILURES:
                        peer.live = False
                        log.warning("event=peer_lost agent=%s peer=%s reason=%s", self.agent_id, address,
                                    str(exc) or type(exc).__name__)
                self.conns.drop(address)

    def heartbeat_loop(self, closed: threading.Event) -> None:
        while not closed.wait(HEARTBEAT_SECONDS):
            self.heartbeat_once()

    def close(self) -> None:
        self.conns.close()
