"""Pinned host memory that device bytes are staged through when no transport reaches device memory directly.

Two transports need it: tcp (a socket reads and writes host memory only) and rdma where the topology gives
the device no GPUDirect NIC (``paths.plan`` places the slice with ``stage_host``). Both take a chunk of one
``StagingPool``: a few large areas, each allocated, page-locked for DMA with the runtime
(``HostRegistration``) and registered with the rdma NICs ONCE, then carved into chunks and reused. So a
staged move is one device-to-host DMA into registered memory and the wire transfer out of it, never a
pageable intermediate copy or a registration per move. The pool grows by another area when every chunk is
in use (peak in-flight staged bytes bound it) and gives everything back at close.

A chunk is returned only when the transport that used it has reported its job: one that never reports (stuck
past a deadline) keeps its chunk, so no later move is overwritten by a straggler.
"""

from __future__ import annotations

import bisect
import logging
import mmap
import threading
from dataclasses import dataclass
from typing import Any

from daybreak.agent.transfer.transport import LocalSegment, address_of

log = logging.getLogger(__name__)

AREA_BYTES = 32 << 20  # one area holds 32 slices of 1 MiB or a few KV blocks; more areas when needed
ALIGN = 4096  # chunks start on a page: what DMA engines and NICs like best


@dataclass(eq=False)
class _Area:
    memory: mmap.mmap
    view: memoryview
    segment: LocalSegment  # what the rdma transport registered (its MRs live in transport_state)
    pinned: bool
    free: list[tuple[int, int]]  # (offset, size), sorted by offset, coalesced


@dataclass(eq=False)
class Chunk:
    """``size`` bytes at ``offset`` of a registered staging area; ``view`` is exactly those bytes."""

    area: _Area
    offset: int
    size: int
    view: memoryview

    @property
    def segment(self) -> LocalSegment:
        return self.area.segment


class StagingPool:
    """Pinned, NIC-registered host areas, carved into chunks for staged device moves.

    ``host`` is the engine: ``pin_host``/``unpin_host`` page-lock a range with its runtime (once),
    ``find_transport("rdma")`` registers each area with the NICs when rdma is up.
    """

    def __init__(self, host: Any, *, area_bytes: int = AREA_BYTES) -> None:
        self._host = host
        self._area_bytes = area_bytes
        self._areas: list[_Area] = []
        self._lock = threading.Lock()
        self.staged: dict[str, int] = {}  # bytes of device memory staged, per transport that carried them

    @property
    def areas(self) -> int:
        return len(self._areas)

    def take(self, size: int, *, transport: str) -> Chunk:
        """A chunk of at least ``size`` bytes (its ``view`` is exactly ``size``), counted for ``transport``."""
        if size <= 0:
            raise ValueError(f"size: must be positive, got {size}")
        need = -(-size // ALIGN) * ALIGN
        with self._lock:
            for area in self._areas:
                chunk = self._carve(area, need, size)
                if chunk is not None:
                    break
            else:
                area = self._new_area(max(self._area_bytes, need))
                chunk = self._carve(area, need, size)
                assert chunk is not None
            self.staged[transport] = self.staged.get(transport, 0) + size
        return chunk

    def give(self, chunk: Chunk) -> None:
        """Return a chunk (once its transport has reported the job)."""
        need = -(-chunk.size // ALIGN) * ALIGN
        with self._lock:
            free = chunk.area.free
            at = bisect.bisect_left(free, (chunk.offset, 0))
            free.insert(at, (chunk.offset, need))
            # coalesce with the neighbours so a large chunk fits again later
            if at + 1 < len(free) and free[at][0] + free[at][1] == free[at + 1][0]:
                free[at] = (free[at][0], free[at][1] + free[at + 1][1])
                del free[at + 1]
            if at > 0 and free[at - 1][0] + free[at - 1][1] == free[at][0]:
                free[at - 1] = (free[at - 1][0], free[at - 1][1] + free[at][1])
                del free[at]

    def _carve(self, area: _Area, need: int, size: int) -> Chunk | None:
        for i, (offset, length) in enumerate(area.free):
            if length >= need:
                if length == need:
                    del area.free[i]
                else:
                    area.free[i] = (offset + need, length - need)
                return Chunk(area, offset, size, area.view[offset:offset + size])
        return None

    def _new_area(self, size: int) -> _Area:
        memory = mmap.mmap(-1, size)  # anonymous, page aligned, never swapped out once pinned
        view = memoryview(memory)
        address = address_of(view)
        pinned = self._host.pin_host(address, size)
        segment = LocalSegment(name=f"staging-{len(self._areas)}", segment_id="", size=size, handle=0,
                               buffer=view, shm=None, device=None)
        rdma = self._host.find_transport("rdma")
        if rdma is not None:
            rdma.register(segment)  # MRs on every NIC, once per area; not served to peers (no handle)
        area = _Area(memory, view, segment, pinned, [(0, size)])
        self._areas.append(area)
        log.info("event=staging_area size=%d pinned=%s rdma=%s areas=%d", size, pinned, rdma is not None,
                 len(self._areas))
        return area

    def close(self) -> None:
        with self._lock:
            areas, self._areas = self._areas, []
        for area in areas:
            rdma = self._host.find_transport("rdma")
            if rdma is not None:
                rdma.unregister(area.segment)
            if area.pinned:
                self._host.unpin_host(address_of(area.view))
            area.segment.buffer = None
            try:
                area.view.release()
                area.memory.close()
            except BufferError:
                pass  # a chunk view is still held somewhere; the mapping goes with the process
