"""The transfer engine: batch READ/WRITE between registered segments over shm, tcp, rdma and link.

Quick tour (one engine per process; every call is thread-safe)::

    from daybreak.agent.transfer import (TransferEngine, TransferRequest, ShmSegment,
                                         SegmentDescriptor, Status)

    engine = TransferEngine(listen="0.0.0.0:0", node="node-a").start()   # or `with TransferEngine(...) as engine:`
    seg = engine.register_segment(ShmSegment.create("kv-0", 1 << 30))    # or any writable buffer, or DeviceMemory
    published = seg.descriptor.to_json()        # small JSON (also .to_bytes()); give it to peers

    # on the peer:
    remote = engine.open_remote(published)      # SegmentDescriptor | JSON str/bytes | dict
    batch = engine.submit([
        TransferRequest.write(remote, 0, memoryview(src)),             # local -> remote[0:len(src)]
        TransferRequest.read(remote, 4096, dst, length=1024),          # remote[4096:5120] -> dst[0:1024]
    ], timeout_s=5.0)                           # the batch deadline; every request carries it
    results = batch.wait()                      # or: results = await batch
    for r in results:                           # r.status: Status.COMPLETED | FAILED | TIMEOUT
        print(r.status.value, r.transport, r.error)   # r.error: the cause, per transport tried
    batch.raise_for_status()                    # TransferError listing what did not complete
    engine.transfer([...])                      # submit + wait + raise_for_status
    view = engine.map_remote(remote)            # same node + shm: read the peer's pages in place

From a process's settings: ``TransferEngine.from_config(EngineConfig.for_agent(settings, token=...))`` in
the agent, ``EngineConfig.for_engine_pod(pod_env, token=...)`` in an engine pod
(``daybreak.client.datapath.engine_for_pod`` does that). This package and ``daybreak.agent.runtime`` are a
library engine pods load: they import nothing else of the agent.

Device memory: pass ``runtime=`` (a ``daybreak.agent.runtime`` runtime) and register its
``DeviceBuffer``; requests then use link (same node), rdma, or shm/tcp staged through host memory.

Local side of a request: any buffer (``memoryview``/``bytearray``/``mmap``, writable for
READ) or a registered ``LocalSegment`` with ``local_offset``; ``length`` defaults to the
rest of it. Bad input raises ``ValueError`` naming the field before anything moves.

Transports, picked per request from the descriptor and this node (``engine.route(remote)``
shows the chain): same node: link (device memory) -> shm -> tcp; other node: rdma -> tcp.
docs/transfer.md has the details (wire format, rdma, link, failure handling).
A path that fails moves the request down its chain; one that keeps failing is tripped by
``CircuitBreaker`` for a cool-down that doubles while it keeps failing (metrics
``daybreak_transfer_path_trips_total`` / ``..._recoveries_total``). shm copies run inline in
``submit``; tcp, rdma and link run on their own threads. Deadlines are enforced by a monitor
thread: a dead or hung peer fails (connection lost) or times out the requests to it, and
``wait`` never blocks past the deadline.
"""

from daybreak.agent.transfer import metrics, wire
from daybreak.agent.transfer.batch import (
    BatchHandle,
    Op,
    RequestResult,
    Status,
    TransferError,
    TransferRequest,
)
from daybreak.agent.transfer.breaker import CircuitBreaker
from daybreak.agent.transfer.config import EngineConfig
from daybreak.agent.transfer.descriptor import DeviceRegion, NicRegion, SegmentDescriptor
from daybreak.agent.transfer.engine import TransferEngine
from daybreak.agent.transfer.transport import DeviceMemory, LocalSegment, RemoteSegment
from daybreak.pool.shm import ShmSegment

__all__ = [
    "BatchHandle",
    "CircuitBreaker",
    "DeviceMemory",
    "DeviceRegion",
    "EngineConfig",
    "LocalSegment",
    "NicRegion",
    "Op",
    "RemoteSegment",
    "RequestResult",
    "SegmentDescriptor",
    "ShmSegment",
    "Status",
    "TransferEngine",
    "TransferError",
    "TransferRequest",
    "metrics",
    "wire",
]
