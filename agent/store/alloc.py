"""Extent allocation inside one fixed-size arena (a shared-memory segment or a device allocation).

Segregated fit (the TLSF idea): free extents are binned by the bit length of
their size, so a request looks at one partly-fitting bin and then takes any
extent from a larger bin; neighbours coalesce on free. Sizes are rounded to
``ALIGN`` so copies stay page-aligned and small leftovers cannot pile up.
"""

from __future__ import annotations

import bisect

ALIGN = 4096


def align_up(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


class Arena:
    """Free-space bookkeeping for ``size`` bytes; offsets are relative to the arena start."""

    def __init__(self, size: int) -> None:
        if size <= 0 or size % ALIGN:
            raise ValueError(f"arena size must be a positive multiple of {ALIGN}, got {size}")
        self.size = size
        self.free_bytes = 0
        self._by_start: dict[int, int] = {}  # start -> length
        self._by_end: dict[int, int] = {}    # end -> start
        self._bins: dict[int, set[int]] = {}  # bit length of length -> starts
        self._starts: list[int] = []  # sorted, to refuse a free that overlaps free space
        self._insert(0, size)

    def _insert(self, start: int, length: int) -> None:
        self._by_start[start] = length
        self._by_end[start + length] = start
        self._bins.setdefault(length.bit_length(), set()).add(start)
        bisect.insort(self._starts, start)
        self.free_bytes += length

    def _delete(self, start: int) -> int:
        length = self._by_start.pop(start)
        del self._by_end[start + length]
        self._bins[length.bit_length()].discard(start)
        del self._starts[bisect.bisect_left(self._starts, start)]
        self.free_bytes -= length
        return length

    def alloc(self, size: int) -> int | None:
        """Reserve ``size`` bytes (rounded up); the start offset, or None when nothing fits."""
        need = align_up(max(size, 1))
        cls = need.bit_length()
        start = None
        for s in self._bins.get(cls, ()):
            if self._by_start[s] >= need:
                start = s
                break
        if start is None:
            for c in range(cls + 1, self.size.bit_length() + 1):
                bin_ = self._bins.get(c)
                if bin_:
                    start = min(bin_)  # lowest address keeps the arena compact
                    break
        if start is None:
            return None
        length = self._delete(start)
        if length > need:
            self._insert(start + need, length - need)
        return start

    def reserve(self, start: int, size: int) -> bool:
        """Mark a known extent used (re-adopting blocks after a restart); False if any of it is taken."""
        need = align_up(max(size, 1))
        if start % ALIGN or start < 0 or start + need > self.size:
            return False
        i = bisect.bisect_right(self._starts, start) - 1
        if i >= 0:
            s = self._starts[i]
            length = self._by_start[s]
            if start + need <= s + length:
                self._delete(s)
                if start > s:
                    self._insert(s, start - s)
                if s + length > start + need:
                    self._insert(start + need, s + length - start - need)
                return True
        return False

    def free(self, start: int, size: int) -> None:
        """Return an extent; coalesces with free neighbours."""
        length = align_up(max(size, 1))
        i = bisect.bisect_right(self._starts, start) - 1
        overlaps_before = i >= 0 and self._starts[i] + self._by_start[self._starts[i]] > start
        overlaps_after = i + 1 < len(self._starts) and self._starts[i + 1] < start + length
        if overlaps_before or overlaps_after or start < 0 or start + length > self.size:
            raise ValueError(f"double free of extent at {start} ({length} bytes)")
        before = self._by_end.get(start)
        if before is not None:
            length += self._delete(before)
            start = before
        after = start + length
        if after in self._by_start:
            length += self._delete(after)
        self._insert(start, length)

    def largest_free(self) -> int:
        return max(self._by_start.values(), default=0)
