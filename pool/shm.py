"""Named shared-memory segments in /dev/shm: the unit of memory the store serves, the client and shm transport map.

A segment outlives the process that created it (that is how a restarted
agent re-adopts its DRAM tier), so creating and unlinking are explicit.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import mmap
import os
import stat
from pathlib import Path
from typing import Any

from daybreak.errors import DaybreakError

log = logging.getLogger(__name__)

SHM_DIR = Path(os.environ.get("DAYBREAK_SHM_DIR", "/dev/shm"))
# Mode of new segments. 0600 unless the agent was told to share them with its primary group
# (``share_with_group``): under the operator that group is the pool's own id, which only the pool's
# engines also hold, so same-node zero copy works for them and for no other pool's engines.
_segment_mode = 0o600


def share_with_group(enabled: bool) -> None:
    """Create later segments mode 0660 (``enabled``) or 0600; set once at agent start-up."""
    global _segment_mode
    _segment_mode = 0o660 if enabled else 0o600


class ShmSegment:
    """A mapping of ``SHM_DIR/<name>``; ``buffer`` is a writable memoryview of all of it."""

    def __init__(self, name: str, size: int, fd: int) -> None:
        self.name = name
        self.size = size
        self._map = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        os.close(fd)
        self.buffer = memoryview(self._map)
        # The mapping's address, for madvise through libc (the export is dropped at once so close() works).
        probe = ctypes.c_char.from_buffer(self._map)
        self.address = ctypes.addressof(probe)
        del probe
        self.closed = False

    @staticmethod
    def path_of(name: str) -> Path:
        if "/" in name or name.startswith("."):
            raise ValueError(f"invalid segment name {name!r}")
        return SHM_DIR / name

    @classmethod
    def create(cls, name: str, size: int, *, exist_ok: bool = False) -> ShmSegment:
        """Create (or with ``exist_ok`` re-adopt) a segment of ``size`` bytes.

        Never through a symlink (``O_NOFOLLOW``), and a file that exists must be a regular file owned
        by this user and closed to others: /dev/shm is world-writable, so anyone could plant one.
        """
        if size <= 0:
            raise ValueError(f"segment size must be positive, got {size}")
        flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | (0 if exist_ok else os.O_EXCL)
        fd = os.open(cls.path_of(name), flags, 0o600)
        try:
            check_owned(fd, cls.path_of(name))
            # Explicitly: the umask would strip the group's write bit from the open() mode.
            os.fchmod(fd, _segment_mode)
        except BaseException:
            os.close(fd)
            raise
        if os.fstat(fd).st_size != size:
            os.ftruncate(fd, size)
        return cls(name, size, fd)

    @classmethod
    def attach(cls, name: str) -> ShmSegment:
        """Map an existing segment created by another process."""
        fd = os.open(cls.path_of(name), os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        return cls(name, os.fstat(fd).st_size, fd)

    def close(self) -> None:
        """Unmap; fails with BufferError while exported views are alive."""
        self.buffer.release()
        self._map.close()
        self.closed = True

    def unlink(self) -> None:
        self.path_of(self.name).unlink(missing_ok=True)


class NotOwned(DaybreakError, OSError):
    """A shared-memory file that is not a regular file of this user, or is open to others: never adopted."""


def closed_to_others(st: os.stat_result) -> bool:
    """No access for others, and group access only for this process's own group (the pool's id)."""
    return not st.st_mode & 0o007 and (not st.st_mode & 0o070 or st.st_gid == os.getegid())


def check_owned(fd: int, path: Path) -> None:
    """Raise NotOwned unless ``fd`` is a regular file owned by this user, closed to others and other groups."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or not closed_to_others(st):
        raise NotOwned(f"{path}: not a private regular file of uid {os.geteuid()} "
                       f"(uid {st.st_uid}, mode {oct(st.st_mode & 0o7777)}); remove it, or it is someone else's")


MADV_POPULATE_READ = 22   # Linux 5.14+; Python's mmap module does not name them
MADV_POPULATE_WRITE = 23


def _libc_madvise() -> Any:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        fn = libc.madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


# Through ctypes, which drops the GIL for the call: mmap.madvise holds it, so a background fill
# populating 16 MiB at a time stalled every request thread of the agent for ~10 ms per step
# (measured: a thread doing short GIL-releasing calls ran 64 of them during a 1 GiB fill, 11,910 with this).
_MADVISE = _libc_madvise()


def populate(segment: ShmSegment, start: int, length: int, *, write: bool) -> bool:
    """Fault a range of a mapped segment in with one call, other threads running meanwhile; False where the kernel cannot.

    ``write=False`` maps the pages read-only (cheaper: a reader never writes through the mapping);
    the range must hold pages already, or the kernel allocates them as for a write.
    """
    if segment.closed or start < 0 or length <= 0 or start + length > segment.size:
        return False
    advice = MADV_POPULATE_WRITE if write else MADV_POPULATE_READ
    if _MADVISE is not None:
        if _MADVISE(segment.address + start, length, advice) == 0:
            return True
        log.debug("event=populate_failed errno=%d", ctypes.get_errno())
        return False
    mapping: Any = segment.buffer.obj  # the segment's mmap object
    try:
        mapping.madvise(advice, start, length)
    except (OSError, ValueError, AttributeError):
        return False
    return True


BACKING_WINDOW = 2 << 20  # populate granularity: one madvise per 2 MiB instead of 512 page faults
_READ, _WRITE = 1, 2  # how far a window is backed in this process: mapped for reading, or for writing


class Backing:
    """Which windows of one mapped segment this process has already backed (pages and page tables).

    ``ensure`` populates only the windows an access is about to touch, once each, so the first
    request to a fresh segment pays for its own pages instead of the whole segment's (an agent
    backs its tier in the background; a first put must not wait for that). A reader maps windows
    read-only (measured 5.9 against 4.4 GB/s for a fresh reader copying 1 MiB blocks out); a
    later write upgrades them. Racing callers may populate a window twice, which is harmless:
    populating never changes contents.
    """

    def __init__(self, segment: ShmSegment) -> None:
        self.segment = segment
        self._done = bytearray(-(-segment.size // BACKING_WINDOW))
        self.supported = True

    def ensure(self, start: int, length: int, *, write: bool = True) -> None:
        """Back ``[start, start + length)`` now, window by window (a no-op for windows already backed)."""
        if not self.supported or length <= 0:
            return
        level = _WRITE if write else _READ
        done = self._done
        first = start // BACKING_WINDOW
        last = min((start + length - 1) // BACKING_WINDOW, len(done) - 1)
        i = first
        while i <= last:
            if done[i] >= level:
                i += 1
                continue
            j = i
            while j <= last and done[j] < level:
                j += 1
            begin = i * BACKING_WINDOW
            end = min(j * BACKING_WINDOW, self.segment.size)
            if not populate(self.segment, begin, end - begin, write=write):
                self.supported = False  # old kernel (or closed): page faults back the pages instead
                return
            for k in range(i, j):
                done[k] = max(done[k], level)
            i = j

    def backed(self, start: int, length: int, *, write: bool) -> bool:
        """Whether every window of ``[start, start + length)`` is already backed (for writing with ``write``)."""
        if not self.supported or length <= 0:
            return True
        level = _WRITE if write else _READ
        first = start // BACKING_WINDOW
        last = min((start + length - 1) // BACKING_WINDOW, len(self._done) - 1)
        return min(self._done[first:last + 1], default=level) >= level

    def pending(self) -> list[tuple[int, int]]:
        """Runs of windows not backed for writing yet, as (start, length) byte ranges."""
        runs: list[tuple[int, int]] = []
        i = 0
        while i < len(self._done):
            if self._done[i] >= _WRITE:
                i += 1
                continue
            j = i
            while j < len(self._done) and self._done[j] < _WRITE:
                j += 1
            runs.append((i * BACKING_WINDOW, min(j * BACKING_WINDOW, self.segment.size) - i * BACKING_WINDOW))
            i = j
        return runs
