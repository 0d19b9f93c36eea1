"""Where block bytes live: DRAM in /dev/shm segments (crash-safe journal), SSD files, HBM through a runtime.

The DRAM tier's segments and its journal are files in /dev/shm named after
the pool and the agent, so a restarted agent maps the same memory again and
replays the journal. THE JOURNAL IS WRITTEN IN THE ORDER THAT MAKES A CRASH
HARMLESS: a block's PUT record is appended only after all its bytes are in
place, and a DEL record is appended before its extent is handed out again.
Replay also re-verifies every block's CRC-32C, so a torn or overwritten
block is dropped (a miss), never served.

SSD blocks are one file each (header with key, size and checksum, then the
bytes), written to a temporary name and renamed, and verified on every read.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import re
import stat
import struct
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from daybreak.agent.runtime.base import AcceleratorRuntime
from daybreak.agent.store.alloc import ALIGN, Arena, align_up
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


_SSD_HEAD = struct.Struct("<4sHQI")  # magic, key_len, size, data_crc
_SSD_MAGIC = b"DBS1"


class SsdTier:
    """One file per block under ``directory``; every read re-checks the block's CRC-32C."""

    name = "ssd"

    def __init__(self, *, directory: Path, capacity: int) -> None:
        self.directory = directory
        self.capacity = capacity
        self.used = 0
        directory.mkdir(parents=True, exist_ok=True)

    def path(self, key: str) -> Path:
        digest = hashlib.blake2b(key.encode(), digest_size=16).hexdigest()
        return self.directory / digest[:2] / f"{digest}.blk"

    def scan(self) -> Iterator[tuple[str, int, int]]:
        """(key, size, checksum) of every block file whose header parses; data is checked on read."""
        for path in self.directory.glob("*/*.blk"):
            try:
                with path.open("rb") as f:
                    head = f.read(_SSD_HEAD.size)
                    magic, key_len, size, dcrc = _SSD_HEAD.unpack(head)
                    key = f.read(key_len).decode()
                if magic != _SSD_MAGIC or path.stat().st_size != _SSD_HEAD.size + key_len + size:
                    raise ValueError("bad header or length")
            except (OSError, ValueError, struct.error, UnicodeDecodeError) as exc:
                log.warning("event=ssd_block_dropped path=%s reason=%s", path, exc)
                path.unlink(missing_ok=True)
                continue
            self.used += size
            yield key, size, dcrc

    def write(self, key: str, data: memoryview, checksum: int) -> None:
        path = self.path(key)
        path.parent.mkdir(exist_ok=True)
        tmp = path.with_suffix(".tmp")
        k = key.encode()
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, _SSD_HEAD.pack(_SSD_MAGIC, len(k), len(data), checksum) + k)
            view = data
            while len(view):
                view = view[os.write(fd, view):]
        finally:
            os.close(fd)
        os.replace(tmp, path)
        self.used += len(data)

    def read_into(self, key: str, out: memoryview, checksum: int) -> bool:
        """Fill ``out`` with the block; False (and the file removed) when it is missing or corrupt."""
        path = self.path(key)
        try:
            with path.open("rb", buffering=0) as f:
                magic, key_len, size, dcrc = _SSD_HEAD.unpack(f.read(_SSD_HEAD.size))
                stored_key = f.read(key_len).decode(errors="replace")
                got = 0
                while got < len(out):
                    n = f.readinto(out[got:])
                    if not n:
                        break
                    got += n
        except (OSError, struct.error) as exc:
            log.warning("event=ssd_read_failed key=%s reason=%s", key, exc)
            return False
        ok = (magic == _SSD_MAGIC and stored_key == key and size == len(out) and got == size
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


class HbmTier:
    """One device allocation carved by an Arena; bytes move with the runtime's host<->device copies."""

    name = "hbm"

    def __init__(self, *, runtime: AcceleratorRuntime, device: int, capacity: int) -> None:
        self.runtime = runtime
        self.capacity = align_up(capacity)
        self.buffer = runtime.allocate(device, self.capacity)
        self.arena = Arena(self.capacity)

    @property
    def used(self) -> int:
        return self.capacity - self.arena.free_bytes

    def alloc(self, size: int) -> int | None:
        return self.arena.alloc(size)

    def free(self, offset: int, size: int) -> None:
        self.arena.free(offset, size)

    def write(self, offset: int, data: memoryview) -> None:
        self.runtime.copy_to_device(self.buffer, data, offset=offset)

    def read_into(self, offset: int, out: memoryview) -> None:
        self.runtime.copy_to_host(out, self.buffer, offset=offset)

    # -- MemoryTier (one device buffer: the segment is always 0) ---------------------------------

    def extent_view(self, segment: int, offset: int, size: int) -> memoryview | None:
        return None  # device memory: not addressable from the host

    def read_extent(self, segment: int, offset: int, out: memoryview) -> None:
        self.read_into(offset, out)

    def write_extent(self, segment: int, offset: int, data: memoryview) -> None:
        self.write(offset, data)

    def shared_name(self, segment: int) -> str:
        return ""  # another process cannot map it (same-node clients GET it instead)

    def close(self) -> None:
        self.runtime.free(self.buffer)
