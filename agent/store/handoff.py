"""Leaving the pool without losing blocks: refuse new writes, then hand every block to its new homes.

An agent that leaves marks itself leaving (peers stop ranking it at their next
heartbeat, sent at once), waits for the writes it already accepted, and pushes
each block to the ``replicas`` agents that rank highest for it among the
others, in batches of ``HANDOFF_BATCH``; only then does it stop. The admission
lock makes "am I leaving?" and "space reserved" one step, so no write slips in
between the decision and the snapshot of what to hand over.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator

from daybreak.agent.store.engine import BlockStore
from daybreak.agent.store.peers import Membership
from daybreak.pool import protocol as p
from daybreak.pool.placement import rank

log = logging.getLogger(__name__)

HANDOFF_BATCH = 32


class HandOff:
    """Admission of writes while serving, and the hand-off of every block when leaving."""

    def __init__(self, *, store: BlockStore, membership: Membership, replicas: int, lease_seconds: int) -> None:
        self.store = store
        self.membership = membership
        self.replicas = replicas
        self.lease_seconds = lease_seconds
        # Held from "am I leaving?" to "space reserved", so leave() never snapshots between the two.
        self._admission = threading.Lock()

    @contextlib.contextmanager
    def admitting(self, *, replica: bool = False) -> Iterator[bool]:
        """Reserve space inside this block; it yields True when the write is refused (this agent is leaving).

        Writes from other agents (``replica``: a hand-off or a pull) are still accepted while leaving.
        """
        with self._admission:
            yield self.membership.leaving and not replica

    def leave(self) -> int:
        """Hand every block to its new homes among the remaining agents; returns blocks moved."""
        agent_id = self.membership.agent_id
        with self._admission:
            self.membership.leaving = True
        self.membership.heartbeat_once()  # tell the peers now rather than at the next tick
        # Writes accepted before we started leaving must land before the snapshot below,
        # or they would be left behind; new ones are already refused (LEAVING).
        deadline = time.monotonic() + self.lease_seconds
        while self.store.writes_in_flight() and time.monotonic() < deadline:
            time.sleep(0.01)
        targets = self.membership.live_ids(include_self=False)
        if not targets:
            log.info("event=handoff_skipped agent=%s reason=no_live_peers", agent_id)
            return 0
        plan: dict[str, list[str]] = {}
        for block in self.store.keys():
            for agent in rank(block.key, targets)[:self.replicas]:
                plan.setdefault(agent, []).append(block.key)
        moved = 0
        started = time.monotonic()
        for agent, keys in plan.items():
            address = self.membership.address_of(agent)
            for i in range(0, len(keys), HANDOFF_BATCH):
                try:
                    moved += self._push(address, keys[i:i + HANDOFF_BATCH])
                except Exception as exc:  # a peer failing must not stop the others
                    log.warning("event=handoff_failed agent=%s peer=%s keys=%d reason=%s", agent_id, address,
                                len(keys[i:i + HANDOFF_BATCH]), exc)
                    break
        log.info("event=handoff_done agent=%s blocks=%d peers=%d seconds=%.2f", agent_id, moved, len(plan),
                 time.monotonic() - started)
        return moved

    def _push(self, address: str, keys: list[str]) -> int:
        with self.membership.conns.borrow(address) as conn:
            there = conn.exists(keys)
            missing = [k for k, info in zip(keys, there, strict=True) if info.status != p.Status.OK]
            if not missing:
                return 0
            blocks = self.store.acquire(missing)
            try:
                held = [b for b in blocks if b is not None]
                views = [self.store.read_view(b) for b in held]
                infos = conn.put([b.key for b in held], views, [b.checksum for b in held], flags=p.FLAG_REPLICA)
            finally:
                self.store.release(blocks)
            return sum(1 for info in infos if info.status == p.Status.OK)
