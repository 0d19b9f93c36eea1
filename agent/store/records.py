"""Local-first records: which agent holds a block written away from its home, kept at the key's home.

A client writes the first copy to its own node's agent (``FLAG_RECORD``); that
agent tells each key's home "I hold these keys" off the writer's critical path,
and the home answers a later GET or LOCATE of the key with ``REDIRECT`` to the
holder. At most ``MAX_POINTERS`` records are kept, oldest dropped first: a
dropped record costs a pull-through hop, never a lost block.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import OrderedDict

from daybreak.agent.store.engine import BlockStore
from daybreak.agent.store.peers import Membership
from daybreak.pool.placement import rank

log = logging.getLogger(__name__)

MAX_POINTERS = 1 << 20  # records of blocks held elsewhere (local-first writes), oldest dropped first


class Records:
    """Pointers to blocks held elsewhere (at a key's home) and the queue of records to send (at a holder)."""

    def __init__(self, *, store: BlockStore, membership: Membership) -> None:
        self.store = store
        self.membership = membership
        self.pointers: OrderedDict[str, str] = OrderedDict()  # key -> address of the agent holding it
        self._lock = threading.Lock()
        self._outbox: queue.Queue[list[str]] = queue.Queue()

    def __len__(self) -> int:
        return len(self.pointers)

    # -- at the holder ----------------------------------------------------------------------------

    def send_later(self, keys: list[str]) -> None:
        """This agent now holds ``keys``: tell their homes from the record thread."""
        self._outbox.put(keys)

    def run(self, closed: threading.Event) -> None:
        """Tell each key's home that this agent holds it, off the writer's critical path."""
        agent_id = self.membership.agent_id
        while not closed.is_set():
            try:
                keys = self._outbox.get(timeout=0.5)
            except queue.Empty:
                continue
            live = self.membership.live_ids()
            by_home: dict[str, list[str]] = {}
            for key in keys:
                home = rank(key, live)[0] if live else agent_id
                if home != agent_id:
                    by_home.setdefault(home, []).append(key)
            for home, group in by_home.items():
                try:
                    with self.membership.conns.borrow(self.membership.address_of(home), timeout_seconds=5.0) as conn:
                        conn.record(self.membership.address, group)
                except Exception as exc:  # the block is still found by pull-through, just a hop later
                    log.info("event=record_failed agent=%s home=%s keys=%d reason=%s", agent_id, home,
                             len(group), exc)

    # -- at the home --------------------------------------------------------------------------------

    def note(self, holder: str, keys: list[str]) -> None:
        """RECORD from ``holder``: remember it for the keys not held here."""
        held = self.store.exists(keys)
        with self._lock:
            for key, block in zip(keys, held, strict=True):
                if block is None and holder != self.membership.address:
                    self.pointers[key] = holder
                    self.pointers.move_to_end(key)
            while len(self.pointers) > MAX_POINTERS:
                self.pointers.popitem(last=False)

    def pointer(self, key: str) -> str | None:
        with self._lock:
            return self.pointers.get(key)

    def forget_prefix(self, prefix: str) -> int:
        """A namespace was flushed: drop every record of its keys; returns how many went."""
        with self._lock:
            stale = [k for k in self.pointers if k.startswith(prefix)]
            for key in stale:
                del self.pointers[key]
        return len(stale)

    def forget(self, keys: list[str]) -> None:
        """The keys were removed: drop their records too."""
        with self._lock:
            for key in keys:
                self.pointers.pop(key, None)
