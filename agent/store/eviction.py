"""Eviction order for one tier: LRU, and S3-FIFO (the default) which resists one-pass scans.

A policy only orders keys; the tier decides what may go. ``victim(evictable)``
returns the next key the policy would drop among those ``evictable`` accepts
(leased, in-flight and pinned blocks are refused there), or None. Both
policies are O(1) per operation amortised.

S3-FIFO (Yang et al., SOSP'23): new keys enter a small FIFO holding ~10% of
the bytes; a key read again before it reaches the small queue's head moves
to the main FIFO, others leave (their key is remembered in a ghost FIFO, so
a quick return goes straight to main). Main is FIFO with up to 3 second
chances. Agent traffic is scan-heavy (one prefill writes thousands of
blocks that may never be read), which is where it beats LRU.

``FairShare`` sits in front of the policy (issue 22 finding 3): it knows the
bytes each kvNamespace stores in a tier and each namespace's own
least-recently-used order, so the store takes its victims from the namespace
furthest over its fair share (the tier divided by the namespaces that store
something in it) before asking the policy, which then orders what is left.
One tenant writing (or leasing, or pinning) without end thus evicts its own
blocks, not another tenant's working set.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Callable
from typing import Protocol


class Policy(Protocol):
    def insert(self, key: str, size: int) -> None: ...

    def touch(self, key: str) -> None: ...

    def remove(self, key: str) -> None: ...

    def victim(self, evictable: Callable[[str], bool]) -> str | None: ...


class LRU:
    """Least recently used first."""

    def __init__(self) -> None:
        self._order: OrderedDict[str, int] = OrderedDict()

    def insert(self, key: str, size: int) -> None:
        self._order[key] = size
        self._order.move_to_end(key)

    def touch(self, key: str) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def remove(self, key: str) -> None:
        self._order.pop(key, None)

    def victim(self, evictable: Callable[[str], bool]) -> str | None:
        for key in self._order:
            if evictable(key):
                return key
        return None


class S3FIFO:
    """Small/main/ghost FIFOs with frequency bits (0..3)."""

    SMALL_FRACTION = 0.1

    def __init__(self) -> None:
        self._small: OrderedDict[str, int] = OrderedDict()  # key -> size
        self._main: OrderedDict[str, int] = OrderedDict()
        self._ghost: OrderedDict[str, None] = OrderedDict()
        self._freq: dict[str, int] = {}
        self._small_bytes = 0
        self._main_bytes = 0

    def insert(self, key: str, size: int) -> None:
        self.remove(key)
        if key in self._ghost:
            del self._ghost[key]
            self._main[key] = size
            self._main_bytes += size
        else:
            self._small[key] = size
            self._small_bytes += size
        self._freq[key] = 0

    def touch(self, key: str) -> None:
        if key in self._freq:
            self._freq[key] = min(self._freq[key] + 1, 3)

    def remove(self, key: str) -> None:
        if key in self._small:
            self._small_bytes -= self._small.pop(key)
        elif key in self._main:
            self._main_bytes -= self._main.pop(key)
        self._freq.pop(key, None)

    def _remember(self, key: str) -> None:
        self._ghost[key] = None
        # The ghost queue remembers about as many keys as the cache holds.
        while len(self._ghost) > max(16, len(self._small) + len(self._main)):
            self._ghost.popitem(last=False)

    def victim(self, evictable: Callable[[str], bool]) -> str | None:
        # Bounded: every key is looked at a few times at most (freq <= 3 second chances,
        # plus one pass over keys that are not evictable right now).
        budget = 5 * (len(self._small) + len(self._main)) + 8
        skipped_small = 0
        skipped_main = 0
        while budget > 0 and (self._small or self._main):
            budget -= 1
            total = self._small_bytes + self._main_bytes
            use_small = self._small and (
                self._small_bytes > self.SMALL_FRACTION * total or not self._main or skipped_main >= len(self._main)
            ) and skipped_small < len(self._small)
            if use_small:
                key, size = next(iter(self._small.items()))
                if not evictable(key):
                    self._small.move_to_end(key)
                    skipped_small += 1
                    continue
                if self._freq.get(key, 0) > 0:
                    # Read while in probation: promote to main.
                    del self._small[key]
                    self._small_bytes -= size
                    self._main[key] = size
                    self._main_bytes += size
                    self._freq[key] = 0
                    continue
                self._remember(key)
                return key
            if not self._main or skipped_main >= len(self._main):
                if skipped_small >= len(self._small):
                    return None
                skipped_main = len(self._main)
                continue
            key, size = next(iter(self._main.items()))
            if not evictable(key):
                self._main.move_to_end(key)
                skipped_main += 1
                continue
            if self._freq.get(key, 0) > 0:
                self._freq[key] -= 1
                self._main.move_to_end(key)
                continue
            return key
        return None


class FairShare:
    """Bytes stored per namespace in one tier, and each namespace's blocks oldest-used first.

    ``victim`` looks only at namespaces over their share (``capacity / namespaces storing
    something``), furthest over first, and returns the least recently used block of the first
    one that has an evictable block; None sends the caller to the tier's policy. A key
    ``evictable`` refuses (leased, pinned, being read) moves to the back of its namespace's
    order, so a long run of held blocks is passed over once, not at every call.
    """

    def __init__(self) -> None:
        self.bytes: Counter[str] = Counter()
        self._orders: dict[str, OrderedDict[str, int]] = {}

    def insert(self, namespace: str, key: str, size: int) -> None:
        order = self._orders.setdefault(namespace, OrderedDict())
        old = order.pop(key, None)
        if old is not None:
            self.bytes[namespace] -= old
        order[key] = size
        self.bytes[namespace] += size

    def touch(self, namespace: str, key: str) -> None:
        order = self._orders.get(namespace)
        if order is not None and key in order:
            order.move_to_end(key)

    def remove(self, namespace: str, key: str) -> None:
        order = self._orders.get(namespace)
        if order is None or key not in order:
            return
        self.bytes[namespace] -= order.pop(key)
        if not order:
            del self._orders[namespace]
            del self.bytes[namespace]

    def over_share(self, capacity: int) -> list[tuple[str, int]]:
        """(namespace, bytes over its share) for every namespace over it, furthest first."""
        active = len(self._orders)
        if active < 2:
            return []  # one namespace alone owns the whole tier: the policy decides
        share = capacity / active
        over = [(ns, int(n - share)) for ns, n in self.bytes.items() if n > share]
        return sorted(over, key=lambda item: -item[1])

    def victim(self, *, capacity: int, evictable: Callable[[str], bool]) -> str | None:
        for namespace, _ in self.over_share(capacity):
            order = self._orders[namespace]
            for _ in range(len(order)):
                key = next(iter(order))
                if evictable(key):
                    return key
                order.move_to_end(key)
        return None


def make_policy(name: str) -> Policy:
    """``lru`` or ``s3fifo``."""
    if name == "lru":
        return LRU()
    if name == "s3fifo":
        return S3FIFO()
    raise ValueError(f"eviction policy must be 'lru' or 's3fifo', got {name!r}")
