"""Pull-through at a key's home: a GET or LOCATE with ``FLAG_PULL`` that misses here fetches from the others.

That is how a joining agent takes over its share without a rebalance: the
first reads of its keys find them at their previous homes and copy them in.
Peers are asked in rounds (round n asks each remaining key's n-th agent, one
request per agent per round): live peers in rank order first, then the known
but unconfirmed ones, because a leaving agent still holds the blocks it is
handing over (and is no longer ranked) and a joiner's first reads may come
before its heartbeats have marked everyone live.
"""

from __future__ import annotations

import logging
import time

from daybreak.agent.store.engine import BlockStore, Reservation
from daybreak.agent.store.peers import Membership
from daybreak.agent.store.records import Records
from daybreak.pool import protocol as p
from daybreak.pool.checksum import crc32c
from daybreak.pool.placement import rank

log = logging.getLogger(__name__)


class PullThrough:
    """Fetches blocks missing at their home from the other agents, verified by checksum before commit."""

    def __init__(self, *, store: BlockStore, membership: Membership, records: Records) -> None:
        self.store = store
        self.membership = membership
        self.records = records

    def await_writes(self, keys: list[str], *, timeout_seconds: float = 2.0) -> None:
        """Wait for blocks that are arriving right now (a hand-off, a pull, a client) to be committed."""
        deadline = time.monotonic() + timeout_seconds
        while time.monotonic() < deadline and self.store.writes_in_flight(keys):
            time.sleep(0.005)

    def pull(self, keys: list[str]) -> None:
        """At a key's home: fetch blocks missing here from the other agents (a joiner taking over its share)."""
        missing = [k for k, b in zip(keys, self.store.exists(keys), strict=True)
                   if b is None and self.records.pointer(k) is None]
        # A block being written here (say, handed over by a leaving agent) is not missing.
        self.await_writes(missing)
        missing = [k for k, b in zip(missing, self.store.exists(missing), strict=True) if b is None]
        live = self.membership.live_ids(include_self=False)
        unconfirmed = self.membership.unconfirmed(live)
        if not missing or not (live or unconfirmed):
            return
        orders = {key: rank(key, live) + rank(key, unconfirmed) for key in missing}
        remaining = set(missing)
        for position in range(len(live) + len(unconfirmed)):
            # Round n asks each remaining key's n-th agent; one request per agent per round.
            by_peer: dict[str, list[str]] = {}
            for key in remaining:
                by_peer.setdefault(orders[key][position], []).append(key)
            for agent, group in by_peer.items():
                try:
                    self._pull_from(self.membership.address_of(agent), group, remaining)
                except Exception as exc:  # a peer failing must not stop the others
                    log.info("event=pull_failed agent=%s peer=%s reason=%s", self.membership.agent_id, agent, exc)
            if not remaining:
                return
        self.await_writes(list(remaining))  # lost a race with a concurrent write of the same key

    def _pull_from(self, address: str, keys: list[str], remaining: set[str]) -> None:
        with self.membership.conns.borrow(address, timeout_seconds=10.0) as conn:
            infos = conn.exists(keys)
            wanted: list[tuple[str, Reservation]] = []
            for key, info in zip(keys, infos, strict=True):
                if info.status != p.Status.OK:
                    continue
                res = self.store.reserve(key, info.size, info.checksum)
                if isinstance(res, Reservation):
                    wanted.append((key, res))
            if not wanted:
                return
            ok: list[Reservation] = []
            try:
                buffers = [self.store.write_buffer(r) for _, r in wanted]
                results = conn.get_into([k for k, _ in wanted], buffers)
                for (key, res), info, buffer in zip(wanted, results, buffers, strict=True):
                    if info.status == p.Status.OK and info.size == res.size and crc32c(buffer) == res.checksum:
                        self.store.finish_write(res, buffer)
                        ok.append(res)
                        remaining.discard(key)
            finally:
                self.store.commit(ok)
                self.store.commit([r for _, r in wanted if r not in ok], ok=False)
