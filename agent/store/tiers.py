"""Where block bytes live: DRAM in /dev/shm segments (crash-safe journal), SSD files, HBM through a runtime.

The DRAM tier's segments and its journal are files in /dev/shm named after
the pool and the agent, so a restarted agent maps the same memory again and
replays the journal. THE JOURNAL IS WRITTEN IN THE ORDER THAT MAKES A CRASH
HARMLESS: a block's PUT record is appended only after all its bytes are in
place, and a DEL record is appended before its extent is handed out again.
Replay also re-verifies every block's CRC-32C, so a torn or overwritten
block is dropped (a miss), never served.

SSD blocks are one file each (header with key, size, checksum and a MAC made
with a key derived from the pool secret, then the bytes), written to a
temporary name and renamed, verified on every read, under a directory of
their pool's own (``<root>/<namespace>_<name>_<uid>/<agent>``). A file the
pool's key did not sign is refused, never adopted or served.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import hashlib
import hmac
import json
import logging
import os
import re
import shutil
import stat
import struct
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from daybreak.agent.runtime.base import AcceleratorRuntime
from daybreak.agent.store.alloc import ALIGN, Arena, align_up
from daybreak.errors import DaybreakError
from daybreak.pool.checksum import crc32c
from daybreak.pool.shm import SHM_DIR, Backing, ShmSegment, closed_to_others

log = logging.getLogger(__name__)

SEGMENT_MAX_BYTES = 1 << 30
HEAD_BYTES = 256 << 20  # backed before the agent serves: a first second of puts lands in it
_JOURNAL_MAGIC = b"DBJ1"
_REC = struct.Struct("<IBHIQQI")  # record_len, kind, key_len, segment, offset, size, data_crc
_PUT, _DEL = 1, 2


class Tier(Protocol):
    """What the block store asks of every tier: its name and how full it is.

    ``BlockStore`` is the only user of the tiers; the store server and the node side
    reach block bytes through ``BlockStore`` (``read_view``, ``write_buffer``,
    ``location``), never through a tier.
    """

    name: str
    capacity: int

    @property
    def used(self) -> int: ...


class MemoryTier(Tier, Protocol):
    """A tier whose blocks are extents ``(segment, offset, size)`` of memory: DRAM and HBM."""

    def extent_view(self, segment: int, offset: int, size: int) -> memoryview | None:
        """The extent's bytes in place when they are host memory, else None (copy with ``read_extent``)."""
        ...

    def read_extent(self, segment: int, offset: int, out: memoryview) -> None:
        """Copy the extent at ``(segment, offset)`` into ``out`` (``len(out)`` bytes)."""
        ...

    def write_extent(self, segment: int, offset: int, data: memoryview) -> None:
        """Copy ``data`` into the extent at ``(segment, offset)``."""
        ...

    def clear_extent(self, segment: int, offset: int, size: int) -> None:
        """Zero ``size`` bytes at ``(segment, offset)``: what a writer the agent does not watch is handed."""
        ...

    def shared_name(self, segment: int) -> str:
        """The /dev/shm name another process on this node maps to reach ``segment``; '' when it cannot."""
        ...



def slug(text: str) -> str:
    """A name fragment safe for /dev/shm and file names."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", text)[:80]


@dataclass(frozen=True)
class Adopted:
    key: str
    segment: int
    offset: int
    size: int
    checksum: int


class DramTier:
    """Shared-memory segments plus an append-only journal, all under SHM_DIR."""

    name = "dram"

    def __init__(self, *, prefix: str, capacity: int, segment_bytes: int = SEGMENT_MAX_BYTES) -> None:
        if capacity < ALIGN:
            raise ValueError(f"dram_bytes must be at least {ALIGN}, got {capacity}")
        self.prefix = slug(prefix)
        segment_bytes = align_up(min(segment_bytes, capacity))
        count = -(-capacity // segment_bytes)
        last = align_up(capacity - segment_bytes * (count - 1))
        self.sizes = [segment_bytes] * (count - 1) + [last]
        self.capacity = sum(self.sizes)
        self.segments: list[ShmSegment] = []
        self.backing: list[Backing] = []
        self.arenas = [Arena(s) for s in self.sizes]
        self._journal_fd = -1
        self._lock_fd = -1
        self._journal_bytes = 0
        self._live_records = 0

    # -- lifecycle --------------------------------------------------------------------------

    def segment_name(self, index: int) -> str:
        return f"{self.prefix}-dram-{index}"

    @property
    def journal_path(self) -> Path:
        return SHM_DIR / f"{self.prefix}-journal"

    @property
    def lock_path(self) -> Path:
        return SHM_DIR / f"{self.prefix}-lock"

    def names(self) -> list[Path]:
        """Every /dev/shm file this tier may own (segments, journal, probe, lock)."""
        return owned_files(self.prefix)

    def open(self) -> list[Adopted]:
        """Map (or re-adopt) the segments and replay the journal; returns the blocks that verified.

        Takes the tier's lock file first (held while the process lives), so a second agent on the same
        names fails here and the orphan reclaim (``reclaim_orphans``) sees this tier as owned.
        """
        self._lock_fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock_fd)
            raise RuntimeError(f"{self.lock_path} is held by another live agent with the same pool and address; "
                               "stop it first or pick another --listen/--pool") from None
        layout_ok = all(_private_file(ShmSegment.path_of(self.segment_name(i)), size)
                        for i, size in enumerate(self.sizes)) and _private_file(self.journal_path, None)
        if not layout_ok:
            # A different size or no previous run: nothing to adopt, start clean.
            for i in range(len(self.sizes) + 64):
                ShmSegment.path_of(self.segment_name(i)).unlink(missing_ok=True)
            self.journal_path.unlink(missing_ok=True)
        self.segments = [ShmSegment.create(self.segment_name(i), size, exist_ok=True)
                         for i, size in enumerate(self.sizes)]
        self.backing = [Backing(seg) for seg in self.segments]
        self._back_head()
        adopted = self._replay() if layout_ok else []
        self._rewrite_journal(adopted)
        return adopted

    def prefault(self, *, busy: Callable[[], bool] | None = None) -> None:
        """Back the whole tier with memory now (page tables included), so copies never pay first-touch faults.

        Contents are untouched (re-adopted blocks stay valid). Run in a background thread: a
        tier costs about a second per GiB here. The thread runs at the lowest CPU priority, in
        4 MiB steps (madvise through libc, which releases the GIL), and sleeps while ``busy()``
        says requests are being served; requests back their own extents first (``back``), so the
        first puts after a start run at full speed instead of competing with this fill.
        """
        with contextlib.suppress(OSError, AttributeError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)  # this thread only
        chunk = 4 << 20
        started = time.monotonic()
        paused = 0.0
        for backing in list(self.backing):
            for start, length in backing.pending():
                for begin in range(start, start + length, chunk):
                    while busy is not None and busy() and self.segments:
                        time.sleep(0.01)
                        paused += 0.01
                    backing.ensure(begin, min(chunk, start + length - begin))
                    if not backing.supported or not self.segments:
                        log.info("event=prefault_stopped reason=madvise_unavailable_or_closed")
                        return
        log.info("event=prefault_done bytes=%d seconds=%.2f paused_seconds=%.2f", self.capacity,
                 time.monotonic() - started, paused)

    def _back_head(self) -> None:
        """Back the first ``HEAD_BYTES`` of the tier before serving: where the arena puts the first blocks.

        The arena hands out the lowest free addresses first, so the first puts after a start land
        here, in memory that is already backed; the background fill then runs ahead of them.
        """
        started = time.monotonic()
        left = min(HEAD_BYTES, self.capacity)
        for backing in self.backing:
            if left <= 0:
                break
            take = min(left, backing.segment.size)
            backing.ensure(0, take)
            left -= take
        log.info("event=dram_head_backed bytes=%d seconds=%.2f", min(HEAD_BYTES, self.capacity),
                 time.monotonic() - started)

    def back(self, segment: int, offset: int, size: int) -> None:
        """Back one extent with memory now (one madvise per 2 MiB window not yet backed), before bytes land."""
        if segment < len(self.backing):
            self.backing[segment].ensure(offset, size)

    def _replay(self) -> list[Adopted]:
        try:
            raw = self.journal_path.read_bytes()
        except FileNotFoundError:
            return []
        if raw[:4] != _JOURNAL_MAGIC:
            log.warning("event=journal_unreadable path=%s reason=bad_magic", self.journal_path)
            return []
        live: dict[str, Adopted] = {}
        pos = 4
        torn = 0
        while pos + _REC.size + 4 <= len(raw):
            rec_len, kind, key_len, seg, off, size, dcrc = _REC.unpack_from(raw, pos)
            end = pos + rec_len
            if rec_len != _REC.size + key_len + 4 or end > len(raw):
                torn += 1
                break
            (rcrc,) = struct.unpack_from("<I", raw, end - 4)
            if crc32c(raw[pos:end - 4]) != rcrc:
                torn += 1
                break
            key = raw[pos + _REC.size:end - 4].decode(errors="replace")
            if kind == _PUT:
                live[key] = Adopted(key, seg, off, size, dcrc)
            elif kind == _DEL:
                live.pop(key, None)
            pos = end
        good: list[Adopted] = []
        dropped = 0
        for block in live.values():
            if block.segment >= len(self.arenas) or not self.arenas[block.segment].reserve(block.offset, block.size):
                dropped += 1
                continue
            if crc32c(self.view(block.segment, block.offset, block.size)) != block.checksum:
                self.arenas[block.segment].free(block.offset, block.size)
                dropped += 1
                continue
            good.append(block)
        log.info("event=dram_adopted blocks=%d dropped=%d torn_records=%d", len(good), dropped, torn)
        return good

    def _rewrite_journal(self, live: list[Adopted]) -> None:
        tmp = self.journal_path.with_name(self.journal_path.name + ".tmp")
        body = bytearray(_JOURNAL_MAGIC)
        for b in live:
            body += self._record(_PUT, b.key, b.segment, b.offset, b.size, b.checksum)
        tmp.unlink(missing_ok=True)
        # Private: the journal names every key this agent holds.
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(body)
        os.replace(tmp, self.journal_path)
        if self._journal_fd >= 0:
            os.close(self._journal_fd)
        self._journal_fd = os.open(self.journal_path, os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC)
        self._journal_bytes = len(body)
        self._live_records = len(live)

    @staticmethod
    def _record(kind: int, key: str, seg: int, off: int, size: int, dcrc: int) -> bytes:
        k = key.encode()
        head = _REC.pack(_REC.size + len(k) + 4, kind, len(k), seg, off, size, dcrc) + k
        return head + struct.pack("<I", crc32c(head))

    def close(self, *, unlink: bool = False) -> None:
        if self._journal_fd >= 0:
            os.close(self._journal_fd)
            self._journal_fd = -1
        for seg in self.segments:
            try:
                seg.close()
            except BufferError:
                pass  # a view is still alive somewhere; the mapping goes with the process
            if unlink:
                seg.unlink()
        if unlink:
            for path in self.names():
                path.unlink(missing_ok=True)
            log.info("event=dram_removed prefix=%s", self.prefix)
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1
        self.segments = []
        self.backing = []

    # -- space and bytes --------------------------------------------------------------------

    @property
    def used(self) -> int:
        return self.capacity - sum(a.free_bytes for a in self.arenas)

    def alloc(self, size: int) -> tuple[int, int] | None:
        for i, arena in enumerate(self.arenas):
            off = arena.alloc(size)
            if off is not None:
                return i, off
        return None

    def free(self, segment: int, offset: int, size: int) -> None:
        self.arenas[segment].free(offset, size)

    def view(self, segment: int, offset: int, size: int) -> memoryview:
        return self.segments[segment].buffer[offset:offset + size]

    # -- MemoryTier ---------------------------------------------------------------------------

    def extent_view(self, segment: int, offset: int, size: int) -> memoryview | None:
        return self.view(segment, offset, size)

    def read_extent(self, segment: int, offset: int, out: memoryview) -> None:
        out[:] = self.view(segment, offset, len(out))

    def write_extent(self, segment: int, offset: int, data: memoryview) -> None:
        self.view(segment, offset, len(data))[:] = data

    def clear_extent(self, segment: int, offset: int, size: int) -> None:
        if size <= 0:
            return
        # memset through libc (ctypes drops the GIL for it): one pass over the extent, no zero buffer to copy from
        target = ctypes.c_char.from_buffer(self.segments[segment].buffer, offset)
        ctypes.memset(ctypes.addressof(target), 0, size)
        del target  # the export on the mapping must not outlive the call (close() refuses a mapping with exports)

    def shared_name(self, segment: int) -> str:
        return self.segment_name(segment)

    def journal(self, entries: list[tuple[int, str, int, int, int, int]]) -> None:
        """Append (kind, key, segment, offset, size, crc) records in one write; compacts when large."""
        if not entries:
            return
        body = b"".join(self._record(*e) for e in entries)
        os.write(self._journal_fd, body)
        self._journal_bytes += len(body)
        self._live_records += sum(1 if e[0] == _PUT else -1 for e in entries)

    def needs_compaction(self) -> bool:
        return self._journal_bytes > max(8 << 20, 200 * max(self._live_records, 1))

    def compact(self, live: list[Adopted]) -> None:
        self._rewrite_journal(live)


JOURNAL_PUT, JOURNAL_DEL = _PUT, _DEL

_OWNED = re.compile(r"-(dram-\d+|journal|journal\.tmp|probe|lock)$")


def owned_files(prefix: str) -> list[Path]:
    """The /dev/shm files of one tier ``prefix`` (exact names, so a prefix never matches another agent's)."""
    return [path for path in SHM_DIR.glob(f"{prefix}-*") if _OWNED.search(path.name)
            and path.name[:len(path.name) - len(_OWNED.search(path.name).group(0))] == prefix]  # type: ignore[union-attr]


def _private_file(path: Path, size: int | None) -> bool:
    """A regular file of ours, closed to others (and of ``size`` bytes): never a planted one or a symlink."""
    try:
        st = path.lstat()
    except FileNotFoundError:
        return False
    return (stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid() and closed_to_others(st)
            and (size is None or st.st_size == size))


def reclaim_orphans(*, older_than_seconds: float, keep: str = "") -> int:
    """Remove tiers nobody will re-adopt: no live owner (their lock is free) and untouched for the bound.

    A crashed agent restarted within ``older_than_seconds`` still re-adopts its blocks; one that never
    comes back (its pool deleted, its node gone, a benchmark's agent) stops holding RAM. Returns tiers removed.
    """
    removed = 0
    now = time.time()
    for journal in SHM_DIR.glob("daybreak-*-journal"):
        prefix = journal.name.removesuffix("-journal")
        if prefix == keep or not _private_file(journal, None):
            continue
        files = owned_files(prefix)
        try:
            newest = max(p.lstat().st_mtime for p in files)
        except (FileNotFoundError, ValueError):
            continue
        if now - newest < older_than_seconds:
            continue
        lock = SHM_DIR / f"{prefix}-lock"
        fd = -1
        try:
            fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # held: its owner is alive
            if fd >= 0:
                os.close(fd)
            continue
        try:
            for path in files:
                path.unlink(missing_ok=True)
            lock.unlink(missing_ok=True)
        finally:
            os.close(fd)
        removed += 1
        log.info("event=orphan_reclaimed prefix=%s files=%d idle_seconds=%.0f", prefix, len(files), now - newest)
    return removed


# -- SSD tier -------------------------------------------------------------------------------------
#
# Layout: <root>/<pool dir>/<agent dir>/xx/<hash>.blk, where the pool dir is named after the pool that owns
# it (``SsdOwner.dir_name``) and holds a marker, pool.json, naming that pool; the agent dir is one agent's
# (its address), with a ``lock`` file held while the agent runs.

_SSD_HEAD = struct.Struct("<4sHQI16s")  # magic, key_len, size, data_crc, header MAC (16 bytes)
_SSD_MAGIC = b"DBS2"
_SSD_LEGACY_MAGIC = b"DBS1"  # before issue 22: no MAC, one directory for every pool on the node
_SSD_MARKER = "pool.json"
_SSD_LOCK = "lock"
_SSD_SUBDIR = re.compile(r"[0-9a-f]{2}")
_SSD_MAC_BYTES = 16


@dataclass(frozen=True)
class SsdOwner:
    """The pool an SSD directory belongs to, and the key (from the pool secret) its headers are MACed with.

    ``uid`` is the KVPool's metadata.uid in a cluster (a pool deleted and created again under the same
    name gets a new directory); standalone pools have none and are told apart by ``key_id``, a
    fingerprint of the key, so two pools with different secrets never share a directory.
    """

    namespace: str
    name: str
    uid: str
    key: bytes = field(repr=False)

    @classmethod
    def for_pool(cls, *, secret: bytes, namespace: str, name: str, uid: str = "") -> SsdOwner:
        from daybreak.pool.credentials import ssd_header_key

        return cls(namespace=namespace, name=name, uid=uid, key=ssd_header_key(secret))

    @property
    def key_id(self) -> str:
        """A public fingerprint of the key (no secret can be learned from it): what a marker records."""
        return hmac.new(self.key, b"key-id", hashlib.sha256).hexdigest()[:16]

    @property
    def dir_name(self) -> str:
        """``<namespace>_<name>_<uid>`` (``standalone_<name>_<key_id>`` without a uid)."""
        return f"{slug(self.namespace or 'standalone')}_{slug(self.name)}_{slug(self.uid) or self.key_id}"

    def marker(self) -> dict[str, str]:
        """The pool dir's pool.json: who owns it, MACed so another secret's marker is told apart."""
        fields = {"namespace": self.namespace, "name": self.name, "uid": self.uid, "keyId": self.key_id}
        return {**fields, "mac": self._mac(json.dumps(fields, sort_keys=True).encode()).hex()}

    def marker_ok(self, marker: object) -> bool:
        return isinstance(marker, dict) and hmac.compare_digest(json.dumps(marker, sort_keys=True),
                                                                json.dumps(self.marker(), sort_keys=True))

    def header_mac(self, head: bytes, key: bytes) -> bytes:
        """MAC of a block file's header fields and key: binds its key, size and CRC-32C to this pool."""
        return self._mac(head[:_SSD_HEAD.size - _SSD_MAC_BYTES] + key)[:_SSD_MAC_BYTES]

    def _mac(self, data: bytes) -> bytes:
        return hmac.new(self.key, data, hashlib.sha256).digest()


def ssd_directory(*, root: Path, owner: SsdOwner, agent: str) -> Path:
    """Where one agent of ``owner`` keeps its SSD blocks under the configured ``root``."""
    return root / owner.dir_name / slug(agent)


class SsdTier:
    """One file per block under ``directory``, headers MACed with the pool's key; every read re-checks MAC and CRC.

    NOTHING IS ADOPTED THAT THIS POOL'S KEY DID NOT SIGN: a file whose header MAC fails (another pool's,
    planted, or written before issue 22) is refused, counted (``on_refused``), logged once per reason and
    removed, never served. Writes go to a temporary name and are renamed into place, so a crash leaves
    a whole block or none (and stray temporaries are removed at the next start).
    """

    name = "ssd"

    def __init__(self, *, directory: Path, capacity: int, owner: SsdOwner,
                 on_refused: Callable[[str, int], None] | None = None) -> None:
        self.directory = directory
        self.capacity = capacity
        self.owner = owner
        self.used = 0
        self._on_refused = on_refused
        self._lock_fd = -1
        self._foreign = False

    def path(self, key: str) -> Path:
        digest = hashlib.blake2b(key.encode(), digest_size=16).hexdigest()
        return self.directory / digest[:2] / f"{digest}.blk"

    def _refused(self, reason: str, count: int) -> None:
        if count and self._on_refused is not None:
            self._on_refused(reason, count)

    def open(self) -> None:
        """Create (or check) the pool and agent directories, take the agent dir's lock, check the pool marker.

        Refused with an error naming the path: a directory that is a symlink or not this user's (the
        kubelet follows links in a hostPath; nobody else's directory is written into), and a lock held by
        a live agent. A marker written under another secret is logged, its blocks are refused, and the
        marker is replaced by this pool's.
        """
        pool_dir = self.directory.parent
        pool_dir.parent.mkdir(mode=0o700, parents=True, exist_ok=True)  # the root: the admin's, links allowed
        for d in (pool_dir, self.directory):
            d.mkdir(mode=0o700, exist_ok=True)
            st = d.lstat()
            if not stat.S_ISDIR(st.st_mode) or not _owned(st):
                raise RuntimeError(f"SSD tier: {d} is a symlink or not owned by uid {os.geteuid()}; "
                                   "remove it (or pick another ssd_path) and start again")
        self._lock_fd = os.open(self.directory / _SSD_LOCK, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC,
                                0o600)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock_fd)
            self._lock_fd = -1
            raise RuntimeError(f"SSD tier: {self.directory} is held by another live agent of the same pool and "
                               "address; stop it first or pick another --listen/--pool") from None
        os.utime(self.directory / _SSD_LOCK)  # the orphan sweep's clock starts at the last start
        marker_path = pool_dir / _SSD_MARKER
        try:
            found: object = json.loads(marker_path.read_text()) if _private_file(marker_path, None) else None
        except (OSError, ValueError) as exc:
            found = {"unreadable": str(exc)}
        if found is not None and not self.owner.marker_ok(found):
            self._foreign = True
            claimed = found.get("keyId", "?") if isinstance(found, dict) else "?"
            log.warning("event=ssd_dir_refused dir=%s reason=foreign_marker marker_key_id=%s key_id=%s "
                        "action=blocks_refused_marker_replaced", pool_dir, claimed, self.owner.key_id)
        if found is None or self._foreign:
            tmp = pool_dir / f".{_SSD_MARKER}.{os.getpid()}.tmp"
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            with os.fdopen(fd, "w") as f:
                json.dump(self.owner.marker(), f, sort_keys=True)
            os.replace(tmp, marker_path)

    def scan(self) -> Iterator[tuple[str, int, int]]:
        """(key, size, checksum) of every block file this pool's key signed; data is checked on read."""
        if self._lock_fd < 0:
            self.open()
        refused: dict[str, int] = {}
        for tmp in self.directory.glob("*/*.tmp"):  # a write a crash interrupted: never renamed into place
            tmp.unlink(missing_ok=True)
        for path in self.directory.glob("*/*.blk"):
            try:
                if self._foreign:
                    raise _Refused("foreign_dir")
                with path.open("rb") as f:
                    head = f.read(_SSD_HEAD.size)
                    if head[:4] == _SSD_LEGACY_MAGIC:
                        raise _Refused("legacy_unauthenticated")
                    magic, key_len, size, dcrc, mac = _SSD_HEAD.unpack(head)
                    raw_key = f.read(key_len)
                if magic != _SSD_MAGIC or path.stat().st_size != _SSD_HEAD.size + key_len + size:
                    raise _Refused("bad_header")
                if not hmac.compare_digest(mac, self.owner.header_mac(head, raw_key)):
                    raise _Refused("bad_mac")
                key = raw_key.decode()
                if self.path(key) != path:
                    raise _Refused("misplaced")
            except (OSError, struct.error, UnicodeDecodeError):
                reason = "bad_header"
            except _Refused as exc:
                reason = str(exc)
            else:
                self.used += size
                yield key, size, dcrc
                continue
            refused[reason] = refused.get(reason, 0) + 1
            path.unlink(missing_ok=True)
        for reason, count in sorted(refused.items()):
            # One line per reason, not per file: a directory of another pool's files is one event.
            log.warning("event=ssd_blocks_refused dir=%s reason=%s count=%d action=removed_not_adopted",
                        self.directory, reason, count)
            self._refused(reason, count)
        self._foreign = False

    def write(self, key: str, data: memoryview, checksum: int) -> None:
        path = self.path(key)
        path.parent.mkdir(mode=0o700, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        k = key.encode()
        head = _SSD_HEAD.pack(_SSD_MAGIC, len(k), len(data), checksum, b"\0" * _SSD_MAC_BYTES)
        head = head[:-_SSD_MAC_BYTES] + self.owner.header_mac(head, k)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            os.write(fd, head + k)
            view = data
            while len(view):
                view = view[os.write(fd, view):]
        finally:
            os.close(fd)
        os.replace(tmp, path)
        self.used += len(data)

    def read_into(self, key: str, out: memoryview, checksum: int) -> bool:
        """Fill ``out`` with the block; False when it is missing, corrupt or not signed by this pool's key."""
        path = self.path(key)
        try:
            with path.open("rb", buffering=0) as f:
                head = f.read(_SSD_HEAD.size)
                magic, key_len, size, dcrc, mac = _SSD_HEAD.unpack(head)
                raw_key = f.read(key_len)
                got = 0
                while got < len(out):
                    n = f.readinto(out[got:])
                    if not n:
                        break
                    got += n
        except (OSError, struct.error) as exc:
            log.warning("event=ssd_read_failed key=%s reason=%s", key, exc)
            return False
        if not hmac.compare_digest(mac, self.owner.header_mac(head, raw_key)):
            # Replaced after the scan adopted it: refused like any file this pool did not sign.
            log.warning("event=ssd_blocks_refused dir=%s reason=bad_mac count=1 key=%s action=removed_not_served",
                        self.directory, key)
            self._refused("bad_mac", 1)
            return False
        ok = (magic == _SSD_MAGIC and raw_key == key.encode() and size == len(out) and got == size
              and dcrc == checksum and crc32c(out) == checksum)
        if not ok:
            log.warning("event=block_corrupt tier=ssd key=%s action=removed", key)
        return ok

    def remove(self, key: str, size: int) -> None:
        try:
            self.path(key).unlink()
            self.used -= size
        except FileNotFoundError:
            pass

    def close(self, *, remove: bool = False) -> None:
        """Release the lock; ``remove`` deletes this agent's directory (and the pool's, once no agent dir is left)."""
        if remove and self._lock_fd >= 0:
            _remove_tree(self.directory)
            _remove_pool_dir_if_empty(self.directory.parent)
            log.info("event=ssd_removed dir=%s", self.directory)
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1


class _Refused(DaybreakError):
    """A block file the scan does not adopt; the message is the reason counted."""


def _remove_tree(path: Path) -> None:
    """Delete a directory tree without following symlinks (rmtree refuses a symlinked top, never follows inside)."""
    with contextlib.suppress(FileNotFoundError):
        shutil.rmtree(path)


def _remove_pool_dir_if_empty(pool_dir: Path) -> None:
    """Remove a pool dir holding nothing but its marker (and a stray temporary marker)."""
    try:
        left = [p for p in pool_dir.iterdir() if p.name != _SSD_MARKER and not p.name.endswith(".tmp")]
    except FileNotFoundError:
        return
    if not left:
        _remove_tree(pool_dir)


def _agent_dir_idle_seconds(agent_dir: Path, now: float) -> float:
    """Seconds since anything changed in an agent dir: its lock (touched at start) and its xx dirs (every write)."""
    newest = agent_dir.lstat().st_mtime
    for entry in agent_dir.iterdir():
        with contextlib.suppress(FileNotFoundError):
            newest = max(newest, entry.lstat().st_mtime)
    return now - newest


def reclaim_ssd_orphans(*, root: Path, owner: SsdOwner, keep: Path, older_than_seconds: float) -> int:
    """At start: remove agent directories under ``root`` nobody will re-adopt; returns how many went.

    An agent directory (any pool's, this user's, never a symlink) goes when no live agent holds its lock
    and either its pool is known to be gone, or nothing in it changed for ``older_than_seconds`` (the rule
    the DRAM tier's /dev/shm orphans follow). An agent sees only its own KVPool in the API, so "known to be
    gone" is one case: a directory of this pool's namespace and name with another uid (the pool was deleted
    and created again). Legacy directories (``<root>/<address>``, before issue 22, never adopted) go by age.
    Pool dirs left holding only their marker go too. ``keep`` (this agent's own directory) is never touched.
    """
    removed = 0
    now = time.time()
    try:
        entries = sorted(root.iterdir())
    except FileNotFoundError:
        return 0
    for pool_dir in entries:
        if not _own_dir(pool_dir):
            continue
        marker: object = None
        with contextlib.suppress(OSError, ValueError):
            marker = json.loads((pool_dir / _SSD_MARKER).read_text())
        if isinstance(marker, dict):
            replaced = bool(owner.uid and marker.get("namespace") == owner.namespace
                            and marker.get("name") == owner.name and marker.get("uid") != owner.uid)
            candidates = [d for d in sorted(pool_dir.iterdir()) if _own_dir(d)]
        elif _looks_like_agent_dir(pool_dir):
            replaced, candidates = False, [pool_dir]
        else:
            continue  # not a tier this code wrote: leave it alone
        for agent_dir in candidates:
            if agent_dir == keep or not _looks_like_agent_dir(agent_dir):
                continue
            reason = "pool_replaced" if replaced else ("legacy" if agent_dir == pool_dir else "idle")
            if not replaced and _agent_dir_idle_seconds(agent_dir, now) < older_than_seconds:
                continue
            if _remove_if_unlocked(agent_dir):
                removed += 1
                log.info("event=ssd_orphan_reclaimed dir=%s reason=%s", agent_dir, reason)
        if isinstance(marker, dict) and pool_dir != keep.parent:
            _remove_pool_dir_if_empty(pool_dir)
    return removed


def _owned(st: os.stat_result) -> bool:
    """This user's; a root agent (rdma) also takes 65532's, which the ssd-owner init container
    hands the whole root to (``operator/pool.py``) whichever pool's agent created a directory."""
    return st.st_uid == os.geteuid() or os.geteuid() == 0


def _own_dir(path: Path) -> bool:
    try:
        st = path.lstat()
    except FileNotFoundError:
        return False
    return stat.S_ISDIR(st.st_mode) and _owned(st)


def _looks_like_agent_dir(path: Path) -> bool:
    """Only ``lock`` and ``xx`` block subdirectories: the shape SsdTier writes, so nothing else is deleted."""
    names = [p.name for p in path.iterdir()]
    return bool(names) and all(n == _SSD_LOCK or _SSD_SUBDIR.fullmatch(n) for n in names)


def _remove_if_unlocked(agent_dir: Path) -> bool:
    """Remove ``agent_dir`` unless a live agent holds its lock (taken here for the removal)."""
    fd = -1
    try:
        fd = os.open(agent_dir / _SSD_LOCK, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:  # held: its owner is alive
        if fd >= 0:
            os.close(fd)
        return False
    try:
        _remove_tree(agent_dir)
    finally:
        os.close(fd)
    return True


_ZERO_CHUNK = 4 << 20
_zero_buffer = memoryview(b"")


def _zeros(size: int) -> memoryview:
    """A read-only view of at least ``size`` zero bytes, shared (grown once to ``_ZERO_CHUNK`` at most)."""
    global _zero_buffer
    if len(_zero_buffer) < size:
        _zero_buffer = memoryview(bytes(max(size, 1 << 20)))
    return _zero_buffer


class HbmTier:
    """The HBM tier: one allocation of ``capacity`` bytes on every device served, each carved by its own Arena.

    A block lives on one device: its extent's ``segment`` is the position of that device in ``devices``
    (so placement, registration and reads all know which device holds it). A new block goes to the device
    with the most free bytes, which spreads the tier over the devices. Bytes move with the runtime's
    host<->device copies.
    """

    name = "hbm"

    def __init__(self, *, runtime: AcceleratorRuntime, devices: Sequence[int], capacity: int) -> None:
        if not devices:
            raise ValueError("devices: the HBM tier needs at least one accelerator device")
        self.runtime = runtime
        self.devices = tuple(devices)
        self.per_device = align_up(capacity)
        self.buffers: list[Any] = []
        try:
            for device in self.devices:
                self.buffers.append(runtime.allocate(device, self.per_device))
        except BaseException:
            for buffer in self.buffers:
                runtime.free(buffer)
            raise
        self.arenas = [Arena(self.per_device) for _ in self.devices]
        self.capacity = self.per_device * len(self.devices)  # what was allocated, summed over the devices

    @property
    def used(self) -> int:
        return self.capacity - sum(a.free_bytes for a in self.arenas)

    def used_per_device(self) -> dict[int, int]:
        """Bytes in use per device index."""
        return {d: self.per_device - a.free_bytes for d, a in zip(self.devices, self.arenas, strict=True)}

    def alloc(self, size: int) -> tuple[int, int] | None:
        """(segment, offset) on the device with the most free bytes that fits ``size``; None when none does."""
        for segment in sorted(range(len(self.arenas)), key=lambda i: -self.arenas[i].free_bytes):
            offset = self.arenas[segment].alloc(size)
            if offset is not None:
                return segment, offset
        return None

    def free(self, segment: int, offset: int, size: int) -> None:
        self.arenas[segment].free(offset, size)

    def write(self, segment: int, offset: int, data: memoryview) -> None:
        self.runtime.copy_to_device(self.buffers[segment], data, offset=offset)

    def read_into(self, segment: int, offset: int, out: memoryview) -> None:
        self.runtime.copy_to_host(out, self.buffers[segment], offset=offset)

    # -- MemoryTier (the segment is the device's position in ``devices``) ------------------------

    def extent_view(self, segment: int, offset: int, size: int) -> memoryview | None:
        return None  # device memory: not addressable from the host

    def read_extent(self, segment: int, offset: int, out: memoryview) -> None:
        self.read_into(segment, offset, out)

    def write_extent(self, segment: int, offset: int, data: memoryview) -> None:
        self.write(segment, offset, data)

    def clear_extent(self, segment: int, offset: int, size: int) -> None:
        # The runtime has no memset in its narrow interface: copy from one shared zero buffer, a chunk at a time.
        zeros = _zeros(min(size, _ZERO_CHUNK))
        for at in range(0, size, _ZERO_CHUNK):
            n = min(_ZERO_CHUNK, size - at)
            self.write(segment, offset + at, zeros[:n])

    def shared_name(self, segment: int) -> str:
        return ""  # another process cannot map it (same-node clients GET it instead)

    def close(self) -> None:
        for buffer in self.buffers:
            self.runtime.free(buffer)
