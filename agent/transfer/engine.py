"""The transfer engine: registers segments, routes each request to a transport, and owns deadlines and failover.

See ``daybreak.agent.transfer`` for the public API walk-through. Internals:
``submit`` validates every request (bad input raises ``ValueError`` naming the
field before anything moves), turns each into a ``Job`` with a fallback chain
computed from the remote descriptor and this node (same node: link -> shm ->
tcp; other node: rdma -> tcp), and hands jobs to the first transport of their
chain whose path the circuit breaker allows. A transport reports each job
back as done, as a request error (bad offset, unknown segment: no fallback) or
as a path failure (the breaker counts it and the job moves down its chain while
its deadline allows). A monitor thread times out batches at their deadline and
tells the transports to abort what is still in flight for them, so NOTHING
WAITS PAST A DEADLINE: a caller blocked in ``wait`` returns at the deadline even
if a transport thread is stuck in a system call.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Iterable, Sequence
from typing import Any

from daybreak.agent.runtime.base import DeviceBuffer, HostRegistration, RuntimeCallError, Unsupported
from daybreak.agent.transfer import metrics, wire
from daybreak.agent.transfer.batch import BatchHandle, Op, RequestResult, Status, TransferRequest
from daybreak.agent.transfer.breaker import CircuitBreaker
from daybreak.agent.transfer.config import DEFAULT_TIMEOUT_S, EngineConfig
from daybreak.agent.transfer.control import token_scope
from daybreak.agent.transfer.descriptor import SegmentDescriptor
from daybreak.agent.transfer.registry import TRANSPORTS, TransportConfig, check_names, open_transports
from daybreak.agent.transfer.staging import StagingPool
from daybreak.agent.transfer.transport import (
    DeviceMemory,
    Job,
    LocalSegment,
    RemoteSegment,
    Transport,
    address_of,
    byte_view,
    device_buffer,
)
from daybreak.pool import credentials
from daybreak.pool.admission import Caps
from daybreak.pool.credentials import ADMIN, Scope
from daybreak.pool.shm import ShmSegment
from daybreak.pool.tls import TlsContexts

log = logging.getLogger(__name__)

__all__ = ["DEFAULT_TIMEOUT_S", "TRANSPORTS", "DeviceMemory", "Job", "LocalSegment", "RemoteSegment",
           "TransferEngine", "Transport", "default_node_name"]



class _DeadlineMonitor(threading.Thread):
    """Times out batches at their deadline, even if nobody waits on them."""

    def __init__(self) -> None:
        super().__init__(name="transfer-deadlines", daemon=True)
        self._cond = threading.Condition()
        self._heap: list[tuple[float, int, BatchHandle]] = []
        self._seq = itertools.count()
        self._stopped = False
        self._wake_at = float("inf")

    def watch(self, batch: BatchHandle) -> None:
        with self._cond:
            while self._heap and self._heap[0][2].settled():  # keep finished batches from piling up
                heapq.heappop(self._heap)
            heapq.heappush(self._heap, (batch.deadline, next(self._seq), batch))
            # wake the thread only if it sleeps past this deadline: with one timeout for every
            # batch (the usual case) it never needs waking, which saves a thread switch per batch
            if batch.deadline < self._wake_at:
                self._cond.notify()

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify()

    def run(self) -> None:
        while True:
            with self._cond:
                while not self._stopped:
                    while self._heap and self._heap[0][2].settled():
                        heapq.heappop(self._heap)
                    if self._heap and self._heap[0][0] <= time.monotonic():
                        break
                    self._wake_at = self._heap[0][0] if self._heap else float("inf")
                    self._cond.wait(None if not self._heap else self._heap[0][0] - time.monotonic())
                    self._wake_at = 0.0  # awake: watch() need not notify
                if self._stopped:
                    return
                _, _, batch = heapq.heappop(self._heap)
            expired = batch.expire()
            if expired:
                log.warning("transfer batch timed out requests=%d of=%d", expired, batch.size)


class TransferEngine:
    """Moves bytes between registered segments of this process and its peers. One per process is typical.

    Parameters (all keyword-only):
      node: name of this node (default: the host name); shm and link are used only
        between engines whose descriptors name the same node.
      listen: ``host:port`` for the tcp server (port 0 picks a free one); ``advertise``
        overrides the address put into descriptors (default: the bound address).
      transports: which transports to enable, a subset of ``link, rdma, shm, tcp``.
        rdma and link enable themselves only when their hardware layer loads.
      tcp_connections: connections per peer; slice_bytes: largest tcp slice/frame payload.
      checksum: crc32c every tcp slice (both directions).
      token: shared secret checked when a tcp connection opens (empty: none).
      tls: ``pool.tls.TlsContexts`` (an agent's: the store's settings): tcp serves and dials TLS only, a
        plaintext peer is refused; with no ``server`` context (an engine pod's) it dials TLS and serves
        nobody (default: None, plain tcp).
      timeout_s: default deadline of a batch, in seconds.
      caps: ``pool.admission.Caps`` of the tcp server: connections in total and per peer address
        (default: ``Caps()``; an agent's engine takes the store's ``max_connections*`` settings).
      idle_seconds: the tcp server closes an authenticated connection that sends no frame this long.
      verbs: a pyverbs-compatible module for rdma (default: import pyverbs).
      runtime: the accelerator runtime (``daybreak.agent.runtime.AcceleratorRuntime``) for
        device segments: link copies, dma-buf registration, staging (default: none, link off).
      rdma_nics: RDMA device names to use (default: the topology's, else every device found).
      topology: a ``TopologyView`` for NIC ranking and GDR decisions (default: host only).
    """

    def __init__(self, *, node: str | None = None, listen: str = "127.0.0.1:0", advertise: str | None = None,
                 transports: Iterable[str] = TRANSPORTS, tcp_connections: int = 2, slice_bytes: int = 4 << 20,
                 checksum: bool = False, token: str = "", timeout_s: float = DEFAULT_TIMEOUT_S,
                 breaker: CircuitBreaker | None = None, verbs: Any = None, runtime: Any = None,
                 rdma_nics: Sequence[str] | None = None,
                 topology: Any = None, tls: TlsContexts | None = None, caps: Caps | None = None,
                 idle_seconds: float = 300.0) -> None:
        wanted = tuple(transports)
        check_names(wanted)
        if tcp_connections < 1:
            raise ValueError(f"tcp_connections: must be >= 1, got {tcp_connections}")
        if not 4096 <= slice_bytes <= 256 << 20:
            raise ValueError(f"slice_bytes: must be between 4096 and 256 MiB, got {slice_bytes}")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s: must be positive, got {timeout_s}")
        if idle_seconds <= 0:
            raise ValueError(f"idle_seconds: must be positive, got {idle_seconds}")
        self.engine_id = uuid.uuid4().hex[:16]
        self.node = node or default_node_name()
        self.listen = listen
        self.advertise = advertise
        self.tcp_connections = tcp_connections
        self.slice_bytes = slice_bytes
        self.checksum = checksum
        self.token = token
        self.tls = tls
        self.caps = caps or Caps()
        self.idle_seconds = idle_seconds
        self.timeout_s = timeout_s
        self.breaker = breaker or CircuitBreaker()
        self._wanted = wanted
        self._verbs = verbs
        self.runtime = runtime
        self._rdma_nics = list(rdma_nics) if rdma_nics else None
        self._topology = topology
        self._transports: dict[str, Transport] = {}
        self._segments: dict[str, LocalSegment] = {}
        self._by_handle: dict[int, LocalSegment] = {}
        self._remotes: dict[str, RemoteSegment] = {}
        self._handles = itertools.count(1)
        self._lock = threading.Lock()
        self._monitor = _DeadlineMonitor()
        self._metric_children: dict[tuple[str, int], tuple[Any, Any]] = {}
        self._started = False
        self._closed = False
        self._authorizer: Any = None  # set by require_capabilities (a store agent's datapath)
        # What transfers actually used: bytes per transport, and bytes per (preferred, used) fallback.
        self.bytes_used: dict[str, int] = {}
        self.bytes_fell_back: dict[tuple[str, str], int] = {}
        # ... and why they fell back: bytes per (preferred, used, reason) (metrics.FALLBACK_REASONS)
        self.fallback_reasons: dict[tuple[str, str, str], int] = {}
        # Device bytes go through pinned host chunks only where no transport reaches device memory (tcp,
        # rdma without GDR); host ranges are page-locked with the runtime once (address -> size).
        self.staging = StagingPool(self)
        self._pins: dict[int, int] = {}
        self._pin_refused = ""

    @classmethod
    def from_config(cls, config: EngineConfig, *, runtime: Any = None, topology: Any = None,
                    verbs: Any = None) -> TransferEngine:
        """An engine configured from an ``EngineConfig``: the one way a process's settings become an engine (the
        agent's through ``EngineConfig.for_agent``, an engine pod's through ``EngineConfig.for_engine_pod``).
        The hardware handles are not settings and come alongside."""
        return cls(**config.as_kwargs(), runtime=runtime, topology=topology, verbs=verbs)  # type: ignore[arg-type]

    # -- lifecycle -----------------------------------------------------------------------
    def start(self) -> TransferEngine:
        """Start the tcp server and probe rdma/link; returns self. Idempotent."""
        if self._started:
            return self
        config = TransportConfig(listen=self.listen, advertise=self.advertise,
                                 tcp_connections=self.tcp_connections, slice_bytes=self.slice_bytes,
                                 checksum=self.checksum, verbs=self._verbs, runtime=self.runtime,
                                 rdma_nics=self._rdma_nics, topology=self._topology, tls=self.tls,
                                 caps=self.caps, idle_seconds=self.idle_seconds)
        self._transports = open_transports(self, self._wanted, config)
        self._monitor.start()
        self._started = True
        log.info("transfer engine started engine=%s node=%s transports=%s tcp=%s", self.engine_id, self.node,
                 ",".join(self._transports), self.tcp_endpoint or "-")
        return self

    def close(self) -> None:
        """Stop serving and fail nothing silently: callers still waiting hit their deadlines."""
        if self._closed or not self._started:
            self._closed = True
            return
        self._closed = True
        self._monitor.stop()
        self.staging.close()
        for transport in self._transports.values():
            transport.close()  # shm unpins the segments it mapped before unmapping them
        for address in list(self._pins):
            self.unpin_host(address)
        log.info("transfer engine closed engine=%s", self.engine_id)

    def __enter__(self) -> TransferEngine:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def transports(self) -> tuple[str, ...]:
        """Transports that are up in this engine."""
        return tuple(self._transports)

    @property
    def tcp_endpoint(self) -> str:
        tcp = self._transports.get("tcp")
        return getattr(tcp, "endpoint", "") if tcp is not None else ""

    def transport(self, name: str) -> Transport:
        return self._transports[name]

    def find_transport(self, name: str) -> Transport | None:
        """``TransportHost``: another transport of this engine, or None where it is not up."""
        return self._transports.get(name)

    # -- segments ----------------------------------------------------------------------------
    def register_segment(self, memory: ShmSegment | DeviceMemory | DeviceBuffer | Any, *,
                         name: str | None = None, pin: bool = False) -> LocalSegment:
        """Make ``memory`` reachable by peers; returns the segment with its ``descriptor``.

        ``memory`` is a ``ShmSegment`` (reachable by shm, tcp and rdma), any other writable
        host buffer (tcp and rdma), or device memory: the runtime's ``DeviceBuffer`` or a
        ``DeviceMemory`` (link, and rdma with GDR or staging). ``pin``: also page-lock host memory
        for DMA with the runtime (``pin_host``), for a buffer device bytes are copied into or out of.
        """
        self._require_started()
        shm: ShmSegment | None = None
        device: DeviceMemory | None = None
        buffer: memoryview | None = None
        runtime_buffer: DeviceBuffer | None = None
        if isinstance(memory, DeviceBuffer):
            runtime_buffer, memory = memory, DeviceMemory(memory.device, memory.address, memory.size)
        if isinstance(memory, ShmSegment):
            shm, buffer, default_name = memory, byte_view(memory.buffer, field="memory"), memory.name
        elif isinstance(memory, DeviceMemory):
            device, default_name = memory, f"dev{memory.device}-{memory.ptr:x}"
            if memory.size <= 0:
                raise ValueError(f"memory.size: must be positive, got {memory.size}")
        else:
            buffer = byte_view(memory, field="memory")
            if buffer.readonly:
                raise ValueError("memory: segments must be writable (peers WRITE into them)")
            default_name = f"buf-{address_of(buffer):x}"
        size = device.size if device is not None else len(buffer)  # type: ignore[arg-type]
        if size <= 0:
            raise ValueError("memory: segment must not be empty")
        seg_name = name or default_name
        segment_id = f"{self.engine_id}/{seg_name}"
        with self._lock:
            if segment_id in self._segments:
                raise ValueError(f"name: segment {seg_name!r} is already registered")
            handle = next(self._handles)
        segment = LocalSegment(name=seg_name, segment_id=segment_id, size=size, handle=handle, buffer=buffer,
                               shm=shm, device=device)
        if device is not None:
            segment.transport_state["device_buffer"] = runtime_buffer or DeviceBuffer(device.device, device.ptr,
                                                                                       device.size)
        for transport in self._transports.values():
            transport.register(segment)
        segment.descriptor = SegmentDescriptor(
            segment_id=segment_id, engine_id=self.engine_id, node=self.node, size=size,
            kind="device" if device is not None else "host",
            shm_name=shm.name if shm is not None and "shm" in self._transports else "",
            # device memory is served over tcp by staging it through host memory
            tcp_endpoint=self.tcp_endpoint if buffer is not None or self.runtime is not None else "",
            tcp_handle=handle,
            rdma=segment.nic_regions, device=segment.device_region)
        if pin and buffer is not None and segment.address:
            self.pin_host(segment.address, size)
        with self._lock:
            self._segments[segment_id] = segment
            self._by_handle[handle] = segment
        log.info("transfer segment registered segment=%s size=%d kind=%s", segment_id, size, segment.kind)
        return segment

    def unregister_segment(self, segment: LocalSegment | str) -> None:
        """Stop serving a segment; peers' later requests to it fail with 'unknown segment'."""
        segment_id = segment if isinstance(segment, str) else segment.segment_id
        with self._lock:
            found = self._segments.pop(segment_id, None)
            if found is not None:
                self._by_handle.pop(found.handle, None)
        if found is None:
            raise KeyError(f"segment {segment_id!r} is not registered")
        for transport in self._transports.values():
            transport.unregister(found)
        if found.address in self._pins and found.device is None:
            self.unpin_host(found.address)

    def served_segment(self, handle: int) -> LocalSegment | None:
        """The local segment a peer addresses by its tcp handle."""
        return self._by_handle.get(handle)

    def local_segments(self) -> list[LocalSegment]:
        return list(self._segments.values())

    # -- host memory for DMA -----------------------------------------------------------------------
    def pin_host(self, address: int, size: int) -> bool:
        """``TransportHost``: page-lock ``[address, address+size)`` with the runtime for DMA, once per range.

        A device copy into pinned memory is one DMA; into pageable memory the driver bounces it through its
        own buffer. False (logged once) where the runtime has no host registration or refuses the range.
        """
        with self._lock:
            if address in self._pins:
                return True
        if self.runtime is None or not isinstance(self.runtime, HostRegistration):
            self._pin_refused = self._pin_refused or "the runtime has no host registration"
            return False
        try:
            self.runtime.register_host(address, size)
        except (Unsupported, RuntimeCallError, ValueError) as exc:
            if not self._pin_refused:
                log.info("event=host_pin_unavailable engine=%s cause=%r", self.engine_id, str(exc))
            self._pin_refused = str(exc)
            return False
        with self._lock:
            self._pins[address] = size
        return True

    def unpin_host(self, address: int) -> None:
        with self._lock:
            found = self._pins.pop(address, None)
        if found is not None and self.runtime is not None:
            try:
                self.runtime.unregister_host(address)
            except (Unsupported, RuntimeCallError) as exc:
                log.warning("event=host_unpin_failed engine=%s cause=%r", self.engine_id, str(exc))

    @property
    def pinned_ranges(self) -> int:
        """Host ranges this engine page-locked and still holds (shm segments it maps, staging areas)."""
        return len(self._pins)

    @property
    def bytes_staged(self) -> dict[str, int]:
        """Device bytes that went through pinned host staging, per transport (none on a direct path)."""
        return dict(self.staging.staged)

    # -- who may reach what ------------------------------------------------------------------------
    def require_capabilities(self, authorize: Any) -> None:
        """From now on every peer request is checked by ``authorize`` (``TransportHost.authorize``'s signature).

        A store agent's datapath installs its capability check here; the engine then also accepts
        peers holding a namespace or agent credential derived from its token (the pool secret), since
        what they may touch is decided per request, not by the credential (docs/protocol.md).
        """
        self._authorizer = authorize

    @property
    def checks_capabilities(self) -> bool:
        return self._authorizer is not None

    def authorize(self, segment: LocalSegment, *, offset: int, length: int, write: bool, capability: bytes,
                  claim: str) -> str:
        if self._authorizer is None:
            return ""  # a plain engine: the handshake admitted only holders of its own token
        problem: str = self._authorizer(segment, offset=offset, length=length, write=write, capability=capability,
                                        claim=claim)
        return problem

    def handshake_key(self, claim: str) -> bytes | None:
        """Its own token's scope always; with capabilities checked, any scope derived from the pool secret."""
        own, key = token_scope(self.token)
        if claim == own.claim:
            return key
        scope = Scope.parse_claim(claim)
        if self._authorizer is None or own.role != ADMIN or scope is None:
            return None
        return credentials.key_for(key, scope)

    def open_remote(self, descriptor: SegmentDescriptor | str | bytes | dict[str, Any]) -> RemoteSegment:
        """Open a peer's segment from its descriptor (object, JSON text/bytes or dict); cached per segment id."""
        if isinstance(descriptor, (str, bytes)):
            descriptor = SegmentDescriptor.from_json(descriptor)
        elif isinstance(descriptor, dict):
            descriptor = SegmentDescriptor.from_dict(descriptor)
        with self._lock:
            remote = self._remotes.get(descriptor.segment_id)
            if remote is not None and remote.descriptor == descriptor:
                return remote
            remote = RemoteSegment(descriptor, same_node=descriptor.node == self.node)
            remote.chain = self._chain(remote, local_device=False)
            self._remotes[descriptor.segment_id] = remote
        return remote

    def map_remote(self, remote: RemoteSegment) -> memoryview:
        """The peer's segment mapped into this process, to read or write in place (zero copies).

        Only for a segment on this node with a /dev/shm name; raises ``ValueError`` otherwise.
        The caller orders its accesses with the peer (a store lease, say): nothing here does.
        """
        shm = self._transports.get("shm")
        if shm is None or not remote.same_node or not remote.descriptor.shm_name:
            raise ValueError(f"remote: segment {remote.segment_id} cannot be mapped here: it needs the same node "
                             f"and a /dev/shm name (node={remote.descriptor.node!r}, this engine: {self.node!r})")
        view: memoryview = shm.map(remote)  # type: ignore[attr-defined]
        return view

    # -- routing ------------------------------------------------------------------------------
    def _chain(self, remote: RemoteSegment, *, local_device: bool) -> tuple[str, ...]:
        """Same node: link (a device segment) -> shm -> tcp; other node: rdma -> tcp.

        Local device memory reaches a same-node DRAM segment by shm as ONE DMA straight into the mapped
        segment (pinned once), and a device segment by link (peer copy, CUDA IPC). Across nodes rdma moves
        it with GPUDirect where the topology allows, else staged through the pinned staging pool; tcp is
        last and always staged (device -> pinned host chunk -> socket).
        """
        d = remote.descriptor
        have = self._transports
        chain: list[str] = []
        if remote.same_node:
            if "link" in have and d.kind == "device":
                chain.append("link")
            if "shm" in have and d.shm_name:
                chain.append("shm")
        elif "rdma" in have and d.rdma:
            chain.append("rdma")
        if "tcp" in have and d.tcp_endpoint and (not local_device or self.runtime is not None):
            chain.append("tcp")
        return tuple(chain)

    def route(self, remote: RemoteSegment) -> tuple[str, ...]:
        """The fallback chain requests from host memory to ``remote`` take, best first."""
        return remote.chain

    # -- submitting ------------------------------------------------------------------------------
    def submit(self, requests: Sequence[TransferRequest], *, timeout_s: float | None = None) -> BatchHandle:
        """Start a batch; returns at once (shm copies run inline) with a handle to wait or await on.

        Raises ``ValueError`` naming the field for a malformed request; nothing moves then.
        """
        self._require_started()
        timeout = self.timeout_s if timeout_s is None else timeout_s
        if timeout <= 0:
            raise ValueError(f"timeout_s: must be positive, got {timeout}")
        batch = BatchHandle(len(requests), deadline=time.monotonic() + timeout, on_expire=self._abort)
        jobs = [self._job(batch, i, request) for i, request in enumerate(requests)]
        if not jobs:
            return batch
        self._dispatch(jobs)
        if not batch.settled():  # shm batches are already done here and need no watching
            self._monitor.watch(batch)
        batch.handed_out = True
        return batch

    def transfer(self, requests: Sequence[TransferRequest], *, timeout_s: float | None = None) -> list[RequestResult]:
        """``submit`` then ``wait``; raises ``TransferError`` if any request did not complete."""
        batch = self.submit(requests, timeout_s=timeout_s)
        batch.wait()
        batch.raise_for_status()
        return batch.results

    def move(self, moves: Sequence[tuple[Any, ...]], *, timeout_s: float | None = None,
             capabilities: Sequence[bytes] | None = None) -> list[tuple[bool, str, str]]:
        """A batch in plain primitives, for callers that cannot import this package (``daybreak.client``).

        Each move is ``(op, remote, remote_offset, local, length)`` with op ``"read"`` or
        ``"write"`` and ``local`` a host buffer, a ``LocalSegment`` or a ``DeviceMemory`` (an optional
        sixth element is the offset into a ``LocalSegment``); ``capabilities``, one per move, are the
        peer's grants (``TransferRequest.capability``). Returns ``(completed, transport, error)`` per
        move, waiting at most ``timeout_s``.
        """
        if capabilities is not None and len(capabilities) != len(moves):
            raise ValueError(f"capabilities: {len(capabilities)} for {len(moves)} moves")
        caps = list(capabilities) if capabilities is not None else [b""] * len(moves)
        requests = [TransferRequest.read(m[1], m[2], m[3], length=m[4], local_offset=m[5] if len(m) > 5 else 0,
                                         capability=c)
                    if m[0] == "read" else
                    TransferRequest.write(m[1], m[2], m[3], length=m[4], local_offset=m[5] if len(m) > 5 else 0,
                                          capability=c)
                    for m, c in zip(moves, caps, strict=True)]
        batch = self.submit(requests, timeout_s=timeout_s)
        batch.wait()
        return [(r.status is Status.COMPLETED, r.transport, r.error) for r in batch.results]

    def device_memory(self, device: int, ptr: int, size: int) -> DeviceMemory:
        """A ``DeviceMemory`` for a caller that holds a raw device pointer (the client library's device buffers)."""
        return DeviceMemory(device, ptr, size)

    def copy_from_device(self, dst: Any, memory: DeviceMemory) -> None:
        """Copy ``memory`` into host buffer ``dst`` (``len(dst)`` bytes) with the runtime: a caller's own staging."""
        if self.runtime is None:
            raise ValueError("memory: device memory needs an engine built with runtime= (the accelerator runtime)")
        self.runtime.copy_to_host(dst, DeviceBuffer(memory.device, memory.ptr, memory.size))

    def copy_to_device(self, memory: DeviceMemory, src: Any) -> None:
        """Copy host buffer ``src`` into the start of ``memory`` with the runtime."""
        if self.runtime is None:
            raise ValueError("memory: device memory needs an engine built with runtime= (the accelerator runtime)")
        self.runtime.copy_to_device(DeviceBuffer(memory.device, memory.ptr, memory.size), src)

    def record_fallback(self, preferred: str, used: str, reason: str, nbytes: int) -> None:
        """Count ``nbytes`` that ``used`` moved instead of ``preferred``, and why (a metrics.* reason); the
        client calls it when it takes the store's stream (``used="stream"``) after the engine could not."""
        key = (preferred, used)
        self.bytes_fell_back[key] = self.bytes_fell_back.get(key, 0) + nbytes
        why = (preferred, used, reason)
        self.fallback_reasons[why] = self.fallback_reasons.get(why, 0) + nbytes
        metrics.FALLBACK_BYTES.labels(preferred, used).inc(nbytes)
        metrics.FALLBACK_REASONS.labels(preferred, used, reason).inc()

    def path_of(self, remote: RemoteSegment, *, device: int | None, transport: str | None = None,
                registered: bool = False) -> tuple[str, str]:
        """The data path a request from local memory (``device``: its device index; None: host memory) to
        ``remote`` takes on ``transport`` (default: the first of its chain), and why, as ``(path, reason)``.

        Device paths: ``link`` (the peer's device segment: peer copy / CUDA IPC), ``shm-dma`` (a same-node DRAM
        segment: one DMA into the mapped segment), ``rdma-gdr`` (a NIC under the device's PCIe switch reaches
        device memory; ``registered``: the local range is registered with the NICs), ``rdma-staged`` (no such
        NIC, or not registered: one pinned host buffer), ``tcp-staged``. Host memory: the transport's name.
        """
        chain = remote.chain if device is None else self._chain(remote, local_device=True)
        name = transport or (chain[0] if chain else "")
        if not name:
            return "none", "no transport of this engine reaches the segment"
        if device is None:
            return name, "host memory"
        if name == "link":
            return "link", "same node, a device segment: peer copy over the device link (Sunrise Link / CUDA IPC)"
        if name == "shm":
            pinned = "pinned once" if isinstance(self.runtime, HostRegistration) else "the runtime cannot pin"
            return "shm-dma", f"same node, a DRAM segment: one device DMA into the mapped segment ({pinned})"
        if name == "rdma":
            nics = self.gdr_nics(device)
            if nics and registered:
                return "rdma-gdr", f"device {device} and NIC {nics[0]} share a PCIe switch: GPUDirect RDMA"
            why = (f"device {device} has no GPUDirect NIC (none under its PCIe switch)" if not nics
                   else f"device {device}'s memory is not registered with the NICs")
            return "rdma-staged", f"{why}: staged through pinned host memory"
        if name == "tcp":
            return "tcp-staged", "device memory over a socket: staged through pinned host memory"
        return name, "device memory"

    def gdr_nics(self, device: int) -> tuple[str, ...]:
        """NICs that reach ``device``'s memory directly (GPUDirect: same PCIe switch), nearest first."""
        rdma = self._transports.get("rdma")
        return tuple(getattr(getattr(rdma, "view", None), "gdr", {}).get(device, ()))

    def _job(self, batch: BatchHandle, index: int, request: TransferRequest) -> Job:
        where = f"requests[{index}]"
        if not isinstance(request, TransferRequest):
            raise ValueError(f"{where}: expected TransferRequest, got {type(request).__name__}")
        if not isinstance(request.op, Op):
            raise ValueError(f"{where}.op: expected Op.READ or Op.WRITE, got {request.op!r}")
        remote = request.remote
        if not isinstance(remote, RemoteSegment):
            raise ValueError(f"{where}.remote: expected a RemoteSegment from open_remote, got {type(remote).__name__}")
        local = request.local
        local_segment: LocalSegment | None = None
        local_device: DeviceMemory | None = None
        view: memoryview | None = None
        if isinstance(local, LocalSegment):
            local_segment = local
            local_device = local.device
            view = local.buffer
            capacity = local.size
        elif isinstance(local, DeviceMemory):
            local_device = local
            capacity = local.size
        else:
            view = byte_view(local, field=f"{where}.local")
            capacity = len(view)
        offset = request.local_offset
        if offset < 0 or offset > capacity:
            raise ValueError(f"{where}.local_offset: {offset} outside the local buffer of {capacity} bytes")
        length = capacity - offset if request.length is None else request.length
        if length <= 0 or offset + length > capacity:
            raise ValueError(f"{where}.length: {length} bytes at local_offset {offset} do not fit the local "
                             f"buffer of {capacity} bytes")
        if request.remote_offset < 0 or request.remote_offset + length > remote.size:
            raise ValueError(f"{where}.remote_offset: {request.remote_offset}+{length} outside remote segment "
                             f"{remote.segment_id} of {remote.size} bytes")
        if view is not None:
            if request.op is Op.READ and view.readonly:
                raise ValueError(f"{where}.local: READ needs a writable buffer")
            view = view[offset:offset + length]
        chain = remote.chain if local_device is None else self._chain(remote, local_device=True)
        capability = bytes(request.capability or b"")
        if len(capability) > wire.MAX_CAPABILITY:
            raise ValueError(f"{where}.capability: {len(capability)} bytes, at most {wire.MAX_CAPABILITY}")
        return Job(batch=batch, index=index, op=request.op, remote=remote, remote_offset=request.remote_offset,
                   length=length, view=view, local_segment=local_segment, local_offset=offset,
                   local_device=local_device, chain=chain, capability=capability)

    def _dispatch(self, jobs: Iterable[Job]) -> None:
        """Hand each job to the first transport of its remaining chain that the breaker allows."""
        groups: dict[str, list[Job]] = {}
        for job in jobs:
            while job.pos < len(job.chain):
                name = job.chain[job.pos]
                transport = self._transports.get(name)
                reason = metrics.UNSUPPORTED
                if transport is not None and not self.breaker.allow((name, job.peer)):
                    reason = metrics.TRIPPED
                    job.errors.append(f"{name}: path tripped for "
                                      f"{self.breaker.cooldown_left((name, job.peer)):.1f}s more")
                elif transport is not None:
                    if job.view is None and job.local_device is not None and name == "tcp":
                        if not self._stage(job, name):  # device memory on a socket: through a pinned chunk
                            reason = metrics.STAGING_FAILED
                    if transport.supports(job):
                        groups.setdefault(name, []).append(job)
                        break
                    self._unstage_release(job)
                if job.pos == 0:
                    job.fallback_reason = reason
                job.pos += 1
            else:
                self._fail(job, "no transport can reach the segment" if not job.chain else "all transports failed")
        for name, group in groups.items():
            for job in group:
                job.attempts += 1
            try:
                self._transports[name].start(group)
            except Exception as exc:  # a transport that blows up fails its jobs over, it never loses them
                log.exception("transfer transport start failed transport=%s", name)
                for job in group:
                    self.job_path_failed(job, f"{type(exc).__name__}: {exc}", transport=name)

    def _stage(self, job: Job, transport: str) -> bool:
        """Give a device-memory job a chunk of the pinned staging pool (filled now for WRITE, copied back to
        the device on READ); False when the runtime copy failed."""
        if job.local_device is None or self.runtime is None:
            return True  # nothing to stage with: the transport says it cannot carry the job
        device = device_buffer(job)
        chunk = self.staging.take(job.length, transport=transport)
        try:
            if job.op is Op.WRITE:
                self.runtime.copy_to_host(chunk.view, device, offset=job.local_offset)
        except Exception as exc:
            self.staging.give(chunk)
            job.errors.append(f"{transport}: staging device memory into host memory failed: {exc}")
            return False
        metrics.STAGED_BYTES.labels(transport).inc(job.length)
        job.view = chunk.view
        job.bounce = (device, chunk)
        return True

    def _unstage(self, job: Job) -> str:
        """Copy a staged READ into device memory and return its chunk; returns an error text or ''."""
        device, chunk = job.bounce
        problem = ""
        if job.op is Op.READ and self.runtime is not None:
            try:
                self.runtime.copy_to_device(device, chunk.view, offset=job.local_offset)
            except Exception as exc:
                problem = f"copy from pinned staging to the device failed: {exc}"
        self._unstage_release(job)
        return problem

    def _unstage_release(self, job: Job) -> None:
        """Give a staged job's chunk back: only once its transport reported the job (it touches it no more)."""
        if job.bounce is None:
            return
        _, chunk = job.bounce
        job.bounce = None
        job.view = None
        self.staging.give(chunk)

    # -- reports from transports ----------------------------------------------------------------
    def job_done(self, job: Job, *, transport: str) -> None:
        self.jobs_done([job], transport)

    def jobs_done(self, jobs: Sequence[Job], name: str) -> None:
        """``job_done`` for many jobs of one transport (one metrics update per batch: cheap for small KV blocks)."""
        nbytes = [0, 0]
        count = [0, 0]
        peer = ""
        for job in jobs:
            if not self._current(job, name):
                continue
            if job.bounce is not None:
                if not job.pending():  # expired meanwhile: the chunk is the transport's no longer
                    self._unstage_release(job)
                    continue
                problem = self._unstage(job)
                if problem:
                    self.job_path_failed(job, problem, transport=name)
                    continue
            if job.batch.finish(job.index, Status.COMPLETED, transport=name):
                job.batch.results[job.index].attempts = job.attempts
                slot = 1 if job.op is Op.WRITE else 0
                nbytes[slot] += job.length
                count[slot] += 1
                if job.pos:  # a later transport of its chain moved it: count what fell back, and why
                    self.record_fallback(job.chain[0], name, job.fallback_reason or metrics.PATH_FAILED,
                                         job.length)
            if job.peer != peer:
                peer = job.peer
                self.breaker.success((name, peer))
        for slot in (0, 1):
            if count[slot]:
                self.bytes_used[name] = self.bytes_used.get(name, 0) + nbytes[slot]
                requests, moved = self._completed_metrics(name, slot)
                requests.inc(count[slot])
                moved.inc(nbytes[slot])

    def _completed_metrics(self, name: str, slot: int) -> tuple[Any, Any]:
        key = (name, slot)
        children = self._metric_children.get(key)
        if children is None:
            op = "write" if slot else "read"
            children = self._metric_children[key] = (metrics.REQUESTS.labels(name, op, "completed"),
                                                     metrics.BYTES.labels(name, op))
        return children

    def _current(self, job: Job, transport: str) -> bool:
        """False for a report from a transport the job already left (a straggler after a fallback)."""
        return job.pos < len(job.chain) and job.chain[job.pos] == transport

    def job_request_failed(self, job: Job, cause: str, *, transport: str) -> None:
        """The request itself is bad for the peer (unknown segment, range): no fallback would help."""
        if not self._current(job, transport):
            return
        self._unstage_release(job)
        job.errors.append(f"{job.chain[job.pos]}: {cause}")
        self._fail(job, "")

    def job_path_failed(self, job: Job, cause: str, *, transport: str) -> None:
        """The path failed (connection, mapping, NIC): count it against the path and fall back."""
        if not self._current(job, transport):
            return
        self._unstage_release(job)  # the transport reported: it no longer touches the chunk
        name = job.chain[job.pos]
        job.errors.append(f"{name}: {cause}")
        self.breaker.failure((name, job.peer), cause)
        if not job.pending():
            return
        if time.monotonic() >= job.batch.deadline:
            # Most often the abort at the deadline is what broke the path: say the deadline first.
            job.batch.finish(job.index, Status.TIMEOUT, transport=name,
                             error="deadline passed before the request completed; " + "; ".join(job.errors))
            return
        if job.pos == 0:
            job.fallback_reason = metrics.PATH_FAILED
        job.pos += 1
        if job.pos < len(job.chain):
            metrics.FALLBACKS.labels(name, job.chain[job.pos]).inc()
            log.info("transfer fallback from=%s to=%s peer=%s cause=%r", name, job.chain[job.pos], job.peer, cause)
            self._dispatch([job])
        else:
            self._fail(job, "")

    def _fail(self, job: Job, cause: str) -> None:
        name = job.chain[min(job.pos, len(job.chain) - 1)] if job.chain else ""
        errors = "; ".join([*job.errors, cause] if cause else job.errors)
        if job.batch.finish(job.index, Status.FAILED, transport=name, error=errors or "failed"):
            job.batch.results[job.index].attempts = job.attempts
            metrics.REQUESTS.labels(name or "none", job.op.value, "failed").inc()
            log.warning("transfer request failed segment=%s op=%s bytes=%d cause=%r", job.remote.segment_id,
                        job.op.value, job.length, errors)

    def _abort(self, batch: BatchHandle) -> None:
        for name, transport in self._transports.items():
            try:
                transport.abort(batch)
            except Exception:
                log.exception("transfer abort failed transport=%s", name)

    def _require_started(self) -> None:
        if not self._started or self._closed:
            raise RuntimeError("TransferEngine is not running: call start() (or use it as a context manager)")


def default_node_name() -> str:
    """The node name engines use when none is given: $NODE_NAME (downward API) or the host name."""
    return os.environ.get("NODE_NAME") or socket.gethostname()
