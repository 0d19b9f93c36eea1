"""The transport interface below the transfer engine: segments, jobs, the ``Transport`` base and how it reports.

A transport sees plain primitives: ``Job``s (local bytes, remote segment and
offset, length) in, and one report per job out through ``Completion``. The
engine implements ``TransportHost`` and passes itself to each transport it
opens (``registry.py``), so no transport imports ``engine.py`` and the engine's
routing, deadlines and failover stay in one place.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from daybreak.agent.runtime.base import DeviceBuffer
from daybreak.agent.transfer.batch import BatchHandle, Op
from daybreak.agent.transfer.descriptor import DeviceRegion, NicRegion, SegmentDescriptor
from daybreak.pool.shm import ShmSegment


@dataclass(frozen=True, slots=True)
class DeviceMemory:
    """A range of accelerator memory from the runtime: device index, device pointer, size in bytes."""

    device: int
    ptr: int
    size: int


class LocalSegment:
    """A segment registered with this engine; ``descriptor`` is what peers need to reach it."""

    def __init__(self, *, name: str, segment_id: str, size: int, handle: int, buffer: memoryview | None,
                 shm: ShmSegment | None, device: DeviceMemory | None) -> None:
        self.name = name
        self.segment_id = segment_id
        self.size = size
        self.handle = handle  # number on this engine's tcp server
        self.buffer = buffer  # host memory; None for device memory
        self.shm = shm
        self.device = device
        self.address = address_of(buffer) if buffer is not None else (device.ptr if device else 0)
        self.nic_regions: tuple[NicRegion, ...] = ()
        self.device_region: DeviceRegion | None = None
        self.descriptor: SegmentDescriptor  # set by the engine once every transport has registered it
        self.transport_state: dict[str, Any] = {}

    @property
    def kind(self) -> str:
        return "device" if self.device is not None else "host"

    def __repr__(self) -> str:
        return f"LocalSegment({self.segment_id!r}, size={self.size}, kind={self.kind})"


class RemoteSegment:
    """A peer's segment opened from its descriptor; pass it as ``TransferRequest.remote``."""

    def __init__(self, descriptor: SegmentDescriptor, *, same_node: bool) -> None:
        self.descriptor = descriptor
        self.segment_id = descriptor.segment_id
        self.size = descriptor.size
        self.same_node = same_node
        self.transport_state: dict[str, Any] = {}
        self.chain: tuple[str, ...] = ()

    def __repr__(self) -> str:
        return f"RemoteSegment({self.segment_id!r}, size={self.size}, chain={'->'.join(self.chain)})"


class Job:
    """One request on its way: the resolved local view, its fallback chain and where in it it is."""

    __slots__ = ("attempts", "batch", "bounce", "capability", "chain", "errors", "fallback_reason", "index", "length",
                 "local_device", "local_offset", "local_segment", "op", "pos", "remote", "remote_offset", "state",
                 "view")

    def __init__(self, *, batch: BatchHandle, index: int, op: Op, remote: RemoteSegment, remote_offset: int,
                 length: int, view: memoryview | None, local_segment: LocalSegment | None, local_offset: int,
                 local_device: DeviceMemory | None, chain: tuple[str, ...], capability: bytes = b"") -> None:
        self.batch = batch
        self.index = index
        self.op = op
        self.remote = remote
        self.remote_offset = remote_offset
        self.length = length
        self.view = view  # host bytes of the local side, exactly ``length`` long
        self.local_segment = local_segment
        self.local_offset = local_offset
        self.local_device = local_device
        self.chain = chain
        self.capability = capability  # the peer's grant for this request (tcp carries it), b'' for none
        self.pos = 0
        self.attempts = 0
        self.errors: list[str] = []
        self.state: Any = None  # scratch for the transport that holds the job
        self.bounce: Any = None  # (device buffer, staging chunk) behind a staged host ``view`` (tcp)
        self.fallback_reason = ""  # why the job left the first transport of its chain (FALLBACK_REASONS)

    @property
    def transport(self) -> str:
        return self.chain[self.pos]

    @property
    def peer(self) -> str:
        return self.remote.descriptor.engine_id

    def pending(self) -> bool:
        return self.batch.is_pending(self.index)


def device_buffer(job: Job) -> DeviceBuffer:
    """The runtime's buffer for a job whose local side is device memory (a registered segment's own, or a view)."""
    assert job.local_device is not None
    if job.local_segment is not None and "device_buffer" in job.local_segment.transport_state:
        buffer: DeviceBuffer = job.local_segment.transport_state["device_buffer"]
        return buffer
    return DeviceBuffer(job.local_device.device, job.local_device.ptr, job.local_device.size)


def address_of(buffer: memoryview) -> int:
    """The address of a writable buffer's first byte (0 for a read-only one)."""
    if buffer.readonly:
        return 0
    return ctypes.addressof(ctypes.c_char.from_buffer(buffer))


def byte_view(obj: Any, *, field: str) -> memoryview:
    """``obj`` as a flat, C-contiguous byte view; ValueError naming ``field`` otherwise."""
    try:
        view = memoryview(obj)
    except TypeError:
        raise ValueError(f"{field}: expected a buffer (memoryview, bytearray, mmap) or a LocalSegment, "
                         f"got {type(obj).__name__}") from None
    if not view.c_contiguous:
        raise ValueError(f"{field}: buffer must be C-contiguous")
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    return view


class Completion(Protocol):
    """Where a transport reports each job it was given: done, a request error, or a path failure.

    Reports from a transport the job already left (a straggler after a fallback) are ignored
    by the implementation, so a transport never needs to check that itself.
    """

    def job_done(self, job: Job, *, transport: str) -> None: ...

    def jobs_done(self, jobs: Sequence[Job], name: str) -> None:
        """``job_done`` for many jobs of one transport at once."""
        ...

    def job_request_failed(self, job: Job, cause: str, *, transport: str) -> None:
        """The request itself is wrong for the peer (unknown segment, range): no fallback would help."""
        ...

    def job_path_failed(self, job: Job, cause: str, *, transport: str) -> None:
        """The path failed (connection, mapping, NIC): the job moves down its chain."""
        ...


class TransportHost(Completion, Protocol):
    """What a transport may use of the engine that runs it: its identity, its segments, and ``Completion``.

    The transfer engine implements it; transports receive it at construction and never
    import the engine.
    """

    @property
    def engine_id(self) -> str: ...

    @property
    def token(self) -> str: ...

    @property
    def tls(self) -> Any:
        """``pool.tls.TlsContexts`` every tcp connection (data and control) uses, or None for plain tcp."""
        ...

    @property
    def runtime(self) -> Any:
        """The accelerator runtime for device segments (staging copies), or None."""
        ...

    @property
    def staging(self) -> Any:
        """The engine's ``staging.StagingPool``: pinned, NIC-registered host chunks for staged device bytes."""
        ...

    def pin_host(self, address: int, size: int) -> bool:
        """Page-lock a host range for DMA with the runtime, once; False where the runtime cannot."""
        ...

    def unpin_host(self, address: int) -> None: ...

    def served_segment(self, handle: int) -> LocalSegment | None:
        """The local segment a peer addresses by its tcp handle."""
        ...

    def local_segments(self) -> list[LocalSegment]: ...

    def find_transport(self, name: str) -> Transport | None:
        """Another transport of the same engine (the tcp server hands RDMA_CONNECT to rdma)."""
        ...

    def handshake_key(self, claim: str) -> bytes | None:
        """The key a peer claiming scope ``claim`` must prove in the tcp handshake; None refuses the claim."""
        ...

    @property
    def checks_capabilities(self) -> bool:
        """Whether this engine's servers check a capability per request (an agent's engine)."""
        ...

    def authorize(self, segment: LocalSegment, *, offset: int, length: int, write: bool, capability: bytes,
                  claim: str) -> str:
        """'' when a peer scoped to ``claim`` may READ/WRITE the range of ``segment``; else why not."""
        ...


class Transport:
    """The cut between the engine and the network: jobs in, reports out through ``Completion``.

    The engine hands each transport a list of ``Job``s whose chain points at it; the
    transport moves their bytes and reports every job exactly once through the
    ``TransportHost`` it was built with. Nothing here knows about batches' fallback order,
    deadlines or the circuit breaker: that is the engine's.
    """

    name = ""

    def supports(self, job: Job) -> bool:
        return True

    def start(self, jobs: list[Job]) -> None:
        raise NotImplementedError

    def abort(self, batch: BatchHandle) -> None:
        """Stop touching the buffers of ``batch`` (its deadline passed)."""

    def register(self, segment: LocalSegment) -> None:
        """Make ``segment`` reachable by peers (fill in its descriptor entries)."""

    def unregister(self, segment: LocalSegment) -> None:
        pass

    def accept(self, request: dict[str, Any]) -> dict[str, Any]:
        """Answer a control message a peer sent for this transport (rdma queue-pair set-up)."""
        raise ValueError(f"{self.name or 'this'} transport takes no control messages")

    def close(self) -> None:
        pass
