"""The node's block index: reservations, commits, reads with leases, watermark eviction, demotion and promotion.

One lock guards the index; bytes are copied outside it. A block is visible to
readers only once committed; a reservation (being written) and a block with
readers or leases are never chosen for eviction. Keys are content-addressed
(a chained hash of the tokens), so writing an existing key again is
idempotent and a re-adopted block can never be stale.

Fair share per kvNamespace (a key's namespace is what precedes its first
``/``; issue 22 finding 3): the index counts, per tier and namespace, the bytes
under leases and parked reservations (``held``) and under soft pins
(``pinned``), and ``admit`` refuses a request that would take a namespace past
its ``Quotas`` with ``QuotaExceeded`` naming the quota, BEFORE anything is
reserved or evicted for it. Eviction takes its victims from the namespace
furthest over its share of the tier first (``eviction.FairShare``), then
follows the tier's policy.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from daybreak.agent.store import metrics as m
from daybreak.agent.store.eviction import FairShare, Policy, make_policy
from daybreak.agent.store.tiers import (
    JOURNAL_DEL,
    JOURNAL_PUT,
    Adopted,
    DramTier,
    HbmTier,
    MemoryTier,
    SsdOwner,
    SsdTier,
    Tier,
)
from daybreak.errors import DaybreakError
from daybreak.pool.protocol import Status
from daybreak.pool.shm import ShmSegment

log = logging.getLogger(__name__)

_WRITES_RECENT_SECONDS = 0.05  # the background fill waits while a write came in this recently

TierNamespace = tuple[str, str]  # (tier, kvNamespace): the unit quotas and fair shares are counted in


def namespace_of(key: str) -> str:
    """The kvNamespace a block key belongs to: what precedes its first ``/`` ('' for a key without one)."""
    namespace, slash, _ = key.partition("/")
    return namespace if slash else ""


class QuotaExceeded(DaybreakError):
    """A request would take a namespace past one of its quotas; nothing was reserved, leased or evicted for it.

    ``quota`` names it (``held``, ``pinned``, ``pin_seconds`` or ``connections``): the store answers
    with an ERROR frame whose text starts with ``quota exceeded`` and keeps the connection open.
    """

    def __init__(self, quota: str, message: str) -> None:
        super().__init__(message)
        self.quota = quota


@dataclass(frozen=True)
class Quotas:
    """What one kvNamespace may hold in one agent (docs/store.md "Fair share"; KVPool ``spec.quotas``)."""

    # Leases and parked (ALLOC/XALLOC, not yet committed) reservations, as a fraction of the tier: at 0.5
    # two namespaces can still each hold half, and one alone can never hold the whole tier.
    held_fraction: float = 0.5
    # Soft pins, as a fraction of the tier: pins are for a few hot prefixes, not a working set.
    pinned_fraction: float = 0.25
    # The longest pin a writer may ask for: a pin outlives its writer, so it must end by itself.
    max_pin_seconds: int = 600

    def __post_init__(self) -> None:
        for name in ("held_fraction", "pinned_fraction"):
            value = getattr(self, name)
            if not 0 < value <= 1:
                raise ValueError(f"{name}: must be in (0, 1], got {value}")
        if self.max_pin_seconds < 0:
            raise ValueError(f"max_pin_seconds: must be >= 0, got {self.max_pin_seconds}")


@dataclass
class Block:
    key: str
    size: int
    checksum: int
    tier: str                 # "dram", "ssd" or "hbm"
    segment: int = 0          # dram segment index
    offset: int = 0           # dram/hbm offset
    readers: int = 0          # tcp sends and leases in progress
    pinned_until: float = 0.0
    staged: memoryview | None = None  # an SSD block read into plain memory when DRAM had no room


@dataclass
class Reservation:
    """Space reserved for a block being written; invisible to readers until committed."""

    key: str
    size: int
    checksum: int
    tier: str
    segment: int
    offset: int
    pin_seconds: int = 0
    cleared: bool = False  # zeroed before it was handed out (``BlockStore.clear``): it can hold no residue


@dataclass
class Lease:
    keys: list[str]
    expires: float
    charges: Counter[TierNamespace] = field(default_factory=Counter)  # bytes held, given back when it ends


@dataclass
class Parked:
    """ALLOC/XALLOC reservations waiting for their COMMIT, and the bytes they hold per namespace."""

    reservations: list[Reservation | None]
    expires: float
    charges: Counter[TierNamespace] = field(default_factory=Counter)


@dataclass
class StoreConfig:
    prefix: str
    dram_bytes: int
    ssd_path: str = ""
    ssd_bytes: int = 0
    policy: str = "s3fifo"
    high_watermark: float = 0.9
    low_watermark: float = 0.8
    lease_seconds: float = 10.0
    max_block_bytes: int = 1 << 30
    quotas: Quotas = field(default_factory=Quotas)
    hbm: HbmTier | None = None
    ssd_owner: SsdOwner | None = None  # the pool whose key signs the SSD tier's headers (required with ssd_path)
    metrics: m.StoreMetrics = field(default_factory=m.StoreMetrics)


class BlockStore:
    """All the blocks one agent holds, across its tiers."""

    def __init__(self, config: StoreConfig) -> None:
        if not 0 <= config.low_watermark < config.high_watermark <= 1:
            raise ValueError(f"low_watermark ({config.low_watermark}) must be below high_watermark "
                             f"({config.high_watermark}), both in [0, 1]")
        self.config = config
        self.metrics = config.metrics
        self.lock = threading.RLock()
        self.last_write = 0.0  # monotonic time of the last reservation: the background fill yields to writes
        self.dram = DramTier(prefix=config.prefix, capacity=config.dram_bytes)
        self.ssd: SsdTier | None = None
        if config.ssd_path and config.ssd_bytes:
            if config.ssd_owner is None:
                raise ValueError("ssd_owner: the SSD tier needs its pool's identity and key (tiers.SsdOwner)")
            self.ssd = SsdTier(directory=Path(config.ssd_path), capacity=config.ssd_bytes, owner=config.ssd_owner,
                               on_refused=lambda reason, n: self.metrics.ssd_refused.labels(reason=reason).inc(n))
        self.hbm = config.hbm
        # Every tier through its interface, by name (the only place tiers are looked up).
        self.tiers: dict[str, Tier] = {"dram": self.dram}
        if self.ssd is not None:
            self.tiers["ssd"] = self.ssd
        if self.hbm is not None:
            self.tiers["hbm"] = self.hbm
        self.blocks: dict[str, Block] = {}
        # The pool's eviction.policy in every tier (the API promises it so; the SSD tier was once LRU always).
        self.policies: dict[str, Policy] = {name: make_policy(config.policy) for name in ("dram", "ssd", "hbm")}
        self.writing: dict[str, Reservation] = {}
        self.leases: dict[int, Lease] = {}
        self.reservations: dict[int, Parked] = {}
        self._ids = itertools.count(1)
        # Per-namespace accounting (docs/store.md "Fair share"), all under self.lock.
        self.shares: dict[str, FairShare] = {"dram": FairShare(), "ssd": FairShare(), "hbm": FairShare()}
        self.held: Counter[TierNamespace] = Counter()    # bytes under leases and parked reservations
        self.pinned: Counter[TierNamespace] = Counter()  # bytes of blocks pinned now
        self._pins: dict[str, tuple[float, int, TierNamespace]] = {}  # key -> (until, size, where)
        self._pin_heap: list[tuple[float, str]] = []  # (until, key), lazily pruned

    # -- lifecycle ----------------------------------------------------------------------------

    def open(self) -> None:
        for b in self.dram.open():
            self._index(Block(b.key, b.size, b.checksum, "dram", b.segment, b.offset))
        if self.ssd is not None:
            for key, size, dcrc in self.ssd.scan():
                if key in self.blocks:
                    self.ssd.remove(key, size)
                else:
                    self._index(Block(key, size, dcrc, "ssd"))
            self._enforce(self.ssd_tier_name)
        self._report()

    ssd_tier_name = "ssd"

    def close(self, *, unlink: bool = False) -> None:
        with self.lock:
            self.dram.close(unlink=unlink)
            if self.ssd is not None:
                self.ssd.close(remove=unlink)
            if self.hbm is not None:
                self.hbm.close()

    @property
    def shm_prefix(self) -> str:
        """The prefix of this store's /dev/shm names (its segments, its journal, the server's probe)."""
        return self.dram.prefix

    def shm_segments(self) -> list[ShmSegment]:
        """The shared-memory segments of the DRAM tier (the node side registers them with the NICs)."""
        return list(self.dram.segments)

    def prefault(self) -> None:
        """Back the DRAM tier with memory now; run in a background thread (about a second per GiB).

        The fill pauses while writes arrive (``_WRITES_RECENT_SECONDS``): zeroing pages competes with
        the writers' copies for the same memory bandwidth and cores, and a write backs its own extent
        anyway (``back``), so the first seconds after a start go to the requests.
        """
        self.dram.prefault(busy=lambda: time.monotonic() - self.last_write < _WRITES_RECENT_SECONDS)

    def back(self, slots: Iterable[Reservation | Status]) -> None:
        """Back the DRAM extents just reserved with memory before their bytes land (outside the lock).

        Until the background fill reaches them, a fresh tier's pages would be faulted in 4 KiB at
        a time by the writer; one madvise per 2 MiB is what keeps an agent's first puts fast.
        """
        for res in slots:
            if isinstance(res, Reservation) and res.tier == "dram":
                self.dram.back(res.segment, res.offset, res.size)

    def clear(self, slots: Iterable[Reservation | Status]) -> None:
        """Zero reservations whose bytes a writer lands without the agent seeing them (ALLOC, XALLOC); outside the lock.

        A freed extent still holds the bytes of the block that lived there, maybe another
        namespace's. A stream PUT overwrites every byte before its COMMIT, but a one-sided or
        mapped writer may write less (or nothing) and COMMIT: without this, the agent would
        publish (or checksum, for ``FLAG_AGENT_CRC``) the previous owner's bytes under the
        writer's key (docs/security.md, "Reservations never expose residue"). Zeroing at
        hand-out costs one memset of the block, only on these paths; zeroing on free would
        cost it on every removal and eviction, and stream PUTs do not need it.
        """
        for res in slots:
            if isinstance(res, Reservation) and not res.cleared:
                self._memory(res.tier).clear_extent(res.segment, res.offset, res.size)
                res.cleared = True

    def usage(self) -> dict[str, int]:
        """Bytes used per enabled tier."""
        return {name: tier.used for name, tier in self.tiers.items()}

    def _memory(self, tier: str) -> MemoryTier:
        if tier == "hbm" and self.hbm is not None:
            return self.hbm
        if tier == "dram":
            return self.dram
        raise ValueError(f"tier {tier!r} holds no extents (ssd blocks are promoted or staged first)")

    def read_view(self, block: Block) -> memoryview:
        """An acquired block's bytes to send: in place in host memory, else a copy (device memory)."""
        if block.staged is not None:
            return block.staged
        tier = self._memory(block.tier)
        view = tier.extent_view(block.segment, block.offset, block.size)
        if view is not None:
            return view
        out = memoryview(bytearray(block.size))
        tier.read_extent(block.segment, block.offset, out)
        return out

    def write_buffer(self, res: Reservation) -> memoryview:
        """Where a writer lands a reservation's bytes: the tier's memory in place, or a staging buffer.

        Pair with ``finish_write`` (which copies a staging buffer into the tier) before ``commit``.
        """
        view = self._memory(res.tier).extent_view(res.segment, res.offset, res.size)
        return view if view is not None else memoryview(bytearray(res.size))

    def finish_write(self, res: Reservation, data: memoryview) -> None:
        """Complete a write into ``write_buffer(res)``: copy staged bytes into a tier not addressable in place."""
        tier = self._memory(res.tier)
        if tier.extent_view(res.segment, res.offset, res.size) is None:
            tier.write_extent(res.segment, res.offset, data)

    def location(self, item: Block | Reservation) -> tuple[str, int]:
        """Where a same-node process maps the bytes: (/dev/shm name, offset), or ('', 0) where it cannot."""
        if item.tier not in ("dram", "hbm") or (isinstance(item, Block) and item.staged is not None):
            return "", 0
        name = self._memory(item.tier).shared_name(item.segment)
        return (name, item.offset) if name else ("", 0)

    def writes_in_flight(self, keys: Iterable[str] | None = None) -> bool:
        """Whether any block (or any of ``keys``) is being written right now."""
        with self.lock:
            if keys is None:
                return bool(self.writing)
            return any(k in self.writing for k in keys)

    def _index(self, block: Block) -> None:
        self.blocks[block.key] = block
        self.policies[block.tier].insert(block.key, block.size)
        self.shares[block.tier].insert(namespace_of(block.key), block.key, block.size)
        if block.pinned_until > time.monotonic():
            self._unpin(block.key)
            where = (block.tier, namespace_of(block.key))
            self._pins[block.key] = (block.pinned_until, block.size, where)
            self.pinned[where] += block.size
            heapq.heappush(self._pin_heap, (block.pinned_until, block.key))

    # -- writes ---------------------------------------------------------------------------------

    def reserve(self, key: str, size: int, checksum: int, *, tier: str = "dram",
                pin_seconds: int = 0) -> Reservation | Status:
        """Find space for a block about to be written (evicting as needed)."""
        if size > self.config.max_block_bytes or size > max(self.dram.sizes):
            return Status.TOO_LARGE
        self.last_write = time.monotonic()
        with self.lock:
            if key in self.writing:
                return Status.BUSY
            if tier == "hbm" and self.hbm is not None:
                hwhere = self._alloc_hbm(size)
                if hwhere is not None:  # segment: which device (HbmTier.devices) holds the block
                    res = Reservation(key, size, checksum, "hbm", hwhere[0], hwhere[1], pin_seconds)
                    self.writing[key] = res
                    return res
            where = self._alloc_dram(size)
            if where is None:
                return Status.FULL
            res = Reservation(key, size, checksum, "dram", where[0], where[1], pin_seconds)
            self.writing[key] = res
            return res

    def target(self, res: Reservation) -> memoryview:
        """Where the writer copies a DRAM reservation's bytes."""
        return self.dram.view(res.segment, res.offset, res.size)

    def write_hbm(self, res: Reservation, data: memoryview) -> None:
        assert self.hbm is not None
        self.hbm.write(res.segment, res.offset, data)

    def commit(self, reservations: Iterable[Reservation], *, ok: bool = True) -> None:
        """Publish written reservations (or give their space back when ``ok`` is False)."""
        now = time.monotonic()
        journal: list[tuple[int, str, int, int, int, int]] = []
        with self.lock:
            for res in reservations:
                if self.writing.get(res.key) is not res:
                    continue
                del self.writing[res.key]
                if not ok:
                    self._free_space(res.tier, res.segment, res.offset, res.size)
                    continue
                old = self.blocks.get(res.key)
                if old is not None:
                    if old.readers:
                        # Same content (content-addressed key): keep the copy being read.
                        self._free_space(res.tier, res.segment, res.offset, res.size)
                        continue
                    self._drop(old, journal)
                block = Block(res.key, res.size, res.checksum, res.tier, res.segment, res.offset,
                              pinned_until=now + res.pin_seconds if res.pin_seconds else 0.0)
                self._index(block)
                if block.tier == "dram":
                    journal.append((JOURNAL_PUT, block.key, block.segment, block.offset, block.size, block.checksum))
                self.metrics.bytes_in.labels(tier=block.tier).inc(block.size)
            self.dram.journal(journal)
            self._enforce("dram")
            if self.hbm is not None:
                self._enforce("hbm")
            self._report()

    # -- reads ----------------------------------------------------------------------------------

    def acquire(self, keys: list[str], *, count: bool = True) -> list[Block | None]:
        """Pin blocks for reading (promoting SSD hits to DRAM); pair with ``release``.

        ``count=False`` leaves hit/miss metrics to the caller (see ``record``).
        """
        out: list[Block | None] = []
        with self.lock:
            for key in keys:
                block = self.blocks.get(key)
                if block is not None and block.tier == "ssd":
                    block.readers += 1  # keep the SSD copy from being evicted while it moves up
                    promoted = self._promote(block)
                    block.readers -= 1
                    if promoted is None:
                        block = self._stage(block)
                    elif not promoted:
                        block = None
                if count:
                    self.record(block)
                if block is None:
                    out.append(None)
                    continue
                block.readers += 1
                self.policies[block.tier].touch(key)
                self.shares[block.tier].touch(namespace_of(key), key)
                out.append(block)
        return out

    def record(self, block: Block | None) -> None:
        """Count one read: a hit in the block's tier, or a miss."""
        if block is None:
            self.metrics.misses.inc()
        else:
            self.metrics.hits.labels(tier=block.tier).inc()
            self.metrics.bytes_out.labels(tier=block.tier).inc(block.size)

    def release(self, blocks: Iterable[Block | None]) -> None:
        with self.lock:
            for b in blocks:
                if b is not None and b.readers > 0:
                    b.readers -= 1

    def view(self, block: Block) -> memoryview:
        return self.dram.view(block.segment, block.offset, block.size)

    def read_hbm_into(self, block: Block, out: memoryview) -> None:
        assert self.hbm is not None
        self.hbm.read_into(block.segment, block.offset, out)

    def lease(self, blocks: list[Block | None]) -> int:
        """Keep already-acquired blocks from eviction for lease_seconds; returns the lease id."""
        lease_id = next(self._ids)
        charges: Counter[TierNamespace] = Counter()
        for b in blocks:
            if b is not None:
                charges[(b.tier, namespace_of(b.key))] += b.size
        with self.lock:
            self.leases[lease_id] = Lease([b.key for b in blocks if b is not None],
                                          time.monotonic() + self.config.lease_seconds, charges)
            self.held.update(charges)
        return lease_id

    def end_lease(self, lease_id: int) -> None:
        with self.lock:
            lease = self.leases.pop(lease_id, None)
            if lease is not None:
                self._give_back(lease.charges)
                self.release([self.blocks.get(k) for k in lease.keys])

    def expire(self) -> None:
        """Drop leases and reservations whose holder vanished."""
        now = time.monotonic()
        with self.lock:
            for lease_id in [i for i, lease in self.leases.items() if lease.expires < now]:
                self.end_lease(lease_id)
            for rid in [i for i, parked in self.reservations.items() if parked.expires < now]:
                parked = self.reservations.pop(rid)
                self._give_back(parked.charges)
                self.commit([r for r in parked.reservations if r is not None], ok=False)
            self._expire_pins(now)
            self._report_namespaces()

    def park(self, reservations: list[Reservation | None]) -> int:
        """Hold ALLOC/XALLOC reservations until COMMIT or lease expiry (their bytes count as held)."""
        rid = next(self._ids)
        charges: Counter[TierNamespace] = Counter()
        for r in reservations:
            if r is not None:
                charges[(r.tier, namespace_of(r.key))] += r.size
        with self.lock:
            self.reservations[rid] = Parked(reservations, time.monotonic() + self.config.lease_seconds, charges)
            self.held.update(charges)
        return rid

    def grant_deadline(self, grant: int) -> float:
        """When a lease or a parked reservation ends unless released or committed first (``time.monotonic()``)."""
        with self.lock:
            lease = self.leases.get(grant)
            if lease is not None:
                return lease.expires
            parked = self.reservations.get(grant)
            return parked.expires if parked is not None else 0.0

    def grant_live(self, grant: int, *, write: bool) -> bool:
        """Whether a one-sided capability's grant still stands: a reservation for WRITE, a lease for READ.

        Released leases and committed, aborted or expired reservations are gone from these maps,
        which is what revokes their capabilities before they expire."""
        return grant in (self.reservations if write else self.leases)

    def unpark(self, rid: int) -> list[Reservation | None] | None:
        with self.lock:
            parked = self.reservations.pop(rid, None)
            if parked is not None:
                self._give_back(parked.charges)
        return None if parked is None else parked.reservations

    # -- quotas per namespace ----------------------------------------------------------------------

    def admit(self, *, lease: Sequence[str] = (), reserve: Sequence[tuple[str, int]] = (),
              pin: Sequence[tuple[str, int]] = (), tier: str = "dram", pin_seconds: int = 0) -> None:
        """Raise ``QuotaExceeded`` when a request would take a namespace past its quota; call before acting.

        ``lease``: keys a LOCATE/XLOCATE would lease (blocks held now count at their size);
        ``reserve``: (key, size) an ALLOC/XALLOC would park in ``tier``; ``pin``: (key, size) a write
        would pin for ``pin_seconds``. Checked against what the namespace holds right now: two
        requests admitted at the same instant may together overshoot by one request's bytes.
        """
        quotas = self.config.quotas
        if pin and pin_seconds > quotas.max_pin_seconds:
            raise QuotaExceeded("pin_seconds", f"quota exceeded: pin_seconds={pin_seconds} is longer than "
                                f"this pool's maxPinSeconds ({quotas.max_pin_seconds} s); ask for a shorter pin")
        tier = tier if tier in self.tiers else "dram"
        held: Counter[TierNamespace] = Counter()
        pinned: Counter[TierNamespace] = Counter()
        with self.lock:
            for key in lease:
                block = self.blocks.get(key)
                if block is not None:  # an SSD hit is promoted to DRAM before it is leased
                    held[("dram" if block.tier == "ssd" else block.tier, namespace_of(key))] += block.size
            for key, size in reserve:
                held[(tier, namespace_of(key))] += size
            if pin:
                self._expire_pins(time.monotonic())
            for key, size in pin:
                pinned[(tier, namespace_of(key))] += size
            for quota, want, have, fraction, what in (
                    ("held", held, self.held, quotas.held_fraction, "under leases and uncommitted reservations"),
                    ("pinned", pinned, self.pinned, quotas.pinned_fraction, "pinned")):
                for where, size in want.items():
                    capacity = self._usage(where[0])[0]
                    limit = int(fraction * capacity)
                    if size and have[where] + size > limit:
                        self.metrics.quota_refusals.labels(quota=quota).inc()
                        raise QuotaExceeded(quota, (
                            f"quota exceeded: namespace {where[1]!r} would have {have[where] + size} bytes {what} "
                            f"in tier {where[0]}, over its {quota} quota of {limit} bytes ({fraction:g} of "
                            f"{capacity}); " + ("RELEASE leases or COMMIT reservations first" if quota == "held"
                                               else "wait for pins to end or write unpinned")))

    def _give_back(self, charges: Counter[TierNamespace]) -> None:
        self.held.subtract(charges)
        for where in charges:
            if self.held[where] <= 0:
                del self.held[where]

    def _unpin(self, key: str) -> None:
        entry = self._pins.pop(key, None)
        if entry is not None:
            _, size, where = entry
            self.pinned[where] -= size
            if self.pinned[where] <= 0:
                del self.pinned[where]

    def _expire_pins(self, now: float) -> None:
        while self._pin_heap and self._pin_heap[0][0] <= now:
            until, key = heapq.heappop(self._pin_heap)
            entry = self._pins.get(key)
            if entry is not None and entry[0] == until:
                self._unpin(key)

    def namespace_usage(self) -> dict[TierNamespace, tuple[int, int, int]]:
        """(stored, held, pinned) bytes per (tier, namespace) with any of them non-zero."""
        with self.lock:
            self._expire_pins(time.monotonic())
            out: dict[TierNamespace, tuple[int, int, int]] = {}
            wheres = {(tier, ns) for tier, share in self.shares.items() for ns in share.bytes}
            for where in wheres | set(self.held) | set(self.pinned):
                out[where] = (self.shares[where[0]].bytes.get(where[1], 0), self.held.get(where, 0),
                              self.pinned.get(where, 0))
            return out

    def _report_namespaces(self) -> None:
        self.metrics.report_namespaces(self.namespace_usage())

    # -- other ops ---------------------------------------------------------------------------------

    def exists(self, keys: list[str]) -> list[Block | None]:
        with self.lock:
            return [self.blocks.get(k) for k in keys]

    def remove(self, keys: list[str]) -> list[Status]:
        out = []
        journal: list[tuple[int, str, int, int, int, int]] = []
        with self.lock:
            for key in keys:
                block = self.blocks.get(key)
                if block is None:
                    out.append(Status.MISS)
                elif block.readers:
                    out.append(Status.BUSY)
                else:
                    self._drop(block, journal)
                    out.append(Status.OK)
            self.dram.journal(journal)
            self._report()
        return out

    def remove_prefix(self, prefix: str) -> tuple[int, int, int]:
        """Delete every block whose key starts with ``prefix`` from every tier (HBM, DRAM, SSD).

        Returns (blocks deleted, bytes freed, blocks left because a reader holds them: they age out)."""
        if not prefix:
            raise ValueError("remove_prefix needs a non-empty prefix (it would delete the whole store)")
        deleted = freed = busy = 0
        journal: list[tuple[int, str, int, int, int, int]] = []
        with self.lock:
            for block in [b for k, b in self.blocks.items() if k.startswith(prefix)]:
                if block.readers:
                    busy += 1
                    continue
                self._drop(block, journal)
                deleted += 1
                freed += block.size
            self.dram.journal(journal)
            self._report()
        return deleted, freed, busy

    def drop_corrupt(self, key: str) -> bool:
        """A reader saw a checksum mismatch: re-verify here and drop the block if it is really bad."""
        from daybreak.pool.checksum import crc32c

        with self.lock:
            block = self.blocks.get(key)
            if block is None or block.tier != "dram":
                return False
            if crc32c(self.view(block)) == block.checksum:
                return False
            log.warning("event=block_corrupt tier=dram key=%s action=removed", key)
            self.metrics.corrupt.inc()
            block.readers = 0
            journal: list[tuple[int, str, int, int, int, int]] = []
            self._drop(block, journal)
            self.dram.journal(journal)
            return True

    def keys(self) -> list[Block]:
        with self.lock:
            return list(self.blocks.values())

    # -- space management ----------------------------------------------------------------------------

    def _evictable(self, *, pins: bool) -> Callable[[str], bool]:
        now = time.monotonic()

        def ok(key: str) -> bool:
            b = self.blocks.get(key)
            return b is not None and b.readers == 0 and (pins or b.pinned_until <= now)

        return ok

    def _victim(self, tier: str, evictable: Callable[[str], bool]) -> str | None:
        """The next block to evict from ``tier``: from the namespace furthest over its share, else by policy."""
        key = self.shares[tier].victim(capacity=self._usage(tier)[0], evictable=evictable)
        if key is not None:
            self.metrics.fair_share_evictions.labels(tier=tier).inc()
            return key
        return self.policies[tier].victim(evictable)

    def _alloc_dram(self, size: int) -> tuple[int, int] | None:
        where = self.dram.alloc(size)
        if where is not None:
            return where
        # Make room: unpinned victims first, then (soft pins) pinned ones.
        for pins in (False, True):
            evictable = self._evictable(pins=pins)
            while where is None:
                victim = self._victim("dram", evictable)
                if victim is None:
                    break
                self._evict(self.blocks[victim])
                where = self.dram.alloc(size)
            if where is not None:
                return where
        return None

    def _alloc_hbm(self, size: int) -> tuple[int, int] | None:
        assert self.hbm is not None
        where = self.hbm.alloc(size)
        evictable = self._evictable(pins=False)
        while where is None:
            victim = self._victim("hbm", evictable)
            if victim is None:
                return None
            self._evict(self.blocks[victim])
            where = self.hbm.alloc(size)
        return where

    def _enforce(self, tier: str) -> None:
        """Evict from ``tier`` down to the low watermark once it is above the high one."""
        capacity, used = self._usage(tier)
        if capacity == 0 or used <= self.config.high_watermark * capacity:
            return
        evictable = self._evictable(pins=False)
        while used > self.config.low_watermark * capacity:
            victim = self._victim(tier, evictable)
            if victim is None:
                log.warning("event=eviction_stalled tier=%s used=%d capacity=%d reason=all_blocks_leased_or_pinned",
                            tier, used, capacity)
                return
            self._evict(self.blocks[victim])
            capacity, used = self._usage(tier)

    def _usage(self, tier: str) -> tuple[int, int]:
        found = self.tiers.get(tier)
        return (found.capacity, found.used) if found is not None else (0, 0)

    def _evict(self, block: Block) -> None:
        """Move a block one tier down (hbm -> dram -> ssd) or drop it."""
        journal: list[tuple[int, str, int, int, int, int]] = []
        self.metrics.evictions.labels(tier=block.tier).inc()
        if block.tier == "hbm":
            where = self.dram.alloc(block.size) if self.dram.used + block.size <= (
                self.config.high_watermark * self.dram.capacity) else None
            if where is not None:
                assert self.hbm is not None
                self.hbm.read_into(block.segment, block.offset, self.dram.view(where[0], where[1], block.size))
                self._drop(block, journal)
                moved = Block(block.key, block.size, block.checksum, "dram", where[0], where[1])
                self._index(moved)
                journal.append((JOURNAL_PUT, moved.key, moved.segment, moved.offset, moved.size, moved.checksum))
                self.dram.journal(journal)
                return
        if block.tier == "dram" and self.ssd is not None and block.size <= self.ssd.capacity:
            self.ssd.write(block.key, self.view(block), block.checksum)
            self._drop(block, journal)
            self._index(Block(block.key, block.size, block.checksum, "ssd"))
            self.dram.journal(journal)
            self._enforce("ssd")
            return
        self._drop(block, journal)
        self.dram.journal(journal)

    def _drop(self, block: Block, journal: list[tuple[int, str, int, int, int, int]]) -> None:
        """Forget a block and free its space; a DRAM extent's DEL record precedes any reuse."""
        self.blocks.pop(block.key, None)
        self.policies[block.tier].remove(block.key)
        self.shares[block.tier].remove(namespace_of(block.key), block.key)
        self._unpin(block.key)
        if block.tier == "dram":
            journal.append((JOURNAL_DEL, block.key, block.segment, block.offset, block.size, block.checksum))
            # The DEL must reach the journal before the extent can be written again.
            self.dram.journal(journal)
            journal.clear()
        self._free_space(block.tier, block.segment, block.offset, block.size, key=block.key)

    def _free_space(self, tier: str, segment: int, offset: int, size: int, *, key: str = "") -> None:
        if tier == "dram":
            self.dram.free(segment, offset, size)
        elif tier == "hbm" and self.hbm is not None:
            self.hbm.free(segment, offset, size)
        elif tier == "ssd" and self.ssd is not None:
            self.ssd.remove(key, size)

    def _stage(self, block: Block) -> Block | None:
        """Serve an SSD block from plain memory (DRAM is full of blocks being read); None if it is corrupt."""
        assert self.ssd is not None
        staged = memoryview(bytearray(block.size))
        if not self.ssd.read_into(block.key, staged, block.checksum):
            self.metrics.corrupt.inc()
            self._drop(block, [])
            return None
        return Block(block.key, block.size, block.checksum, "ssd", staged=staged)

    def _promote(self, block: Block) -> bool | None:
        """Bring an SSD block into DRAM on a hit: False (block dropped) if corrupt, None if DRAM has no room."""
        assert self.ssd is not None
        where = self._alloc_dram(block.size)
        if where is None:
            return None
        view = self.dram.view(where[0], where[1], block.size)
        journal: list[tuple[int, str, int, int, int, int]] = []
        if not self.ssd.read_into(block.key, view, block.checksum):
            self.dram.free(*where, block.size)
            self.metrics.corrupt.inc()
            self._drop(block, journal)
            return False
        self._drop(block, journal)
        block.tier, block.segment, block.offset = "dram", where[0], where[1]
        self._index(block)
        journal.append((JOURNAL_PUT, block.key, block.segment, block.offset, block.size, block.checksum))
        self.dram.journal(journal)
        self.metrics.promotions.inc()
        return True

    def maybe_compact(self) -> None:
        with self.lock:
            if self.dram.needs_compaction():
                self.dram.compact([Adopted(b.key, b.segment, b.offset, b.size, b.checksum)
                                   for b in self.blocks.values() if b.tier == "dram"])

    def _report(self) -> None:
        for name, tier in self.tiers.items():
            self.metrics.capacity.labels(tier=name).set(tier.capacity)
            self.metrics.used.labels(tier=name).set(tier.used)

    def stats(self) -> dict[str, int]:
        with self.lock:
            counts = {"blocks": len(self.blocks), "dram_used": self.dram.used, "dram_capacity": self.dram.capacity}
            for tier in ("dram", "ssd", "hbm"):
                counts[f"blocks_{tier}"] = sum(1 for b in self.blocks.values() if b.tier == tier)
            counts["ssd_used"] = self.ssd.used if self.ssd else 0
            counts["leases"] = len(self.leases)
            return counts
