"""The link transport: copies on one node through the accelerator runtime (peer copy over the device link).

The peer's side is device memory (an agent's HBM segment): from our device
memory it is the runtime's peer copy (``copy_device``: tangMemcpyPeer /
cuMemcpyPeer, over Sunrise Link or NVLink where the devices are linked), from
host memory the runtime's H2D/D2H copy. (Our device memory into a peer's
host /dev/shm segment is the shm transport's: one DMA into the mapping.) A peer
process's device segment is opened from the IPC handle in its descriptor
(``open_ipc_handle``); device indices are assumed to mean the same devices in
both processes (same node, same visible devices).

Large copies between linked devices are cut into one stripe per link lane
(``PeerLink.links``) and issued in parallel, so a runtime that spreads
concurrent copies over ports uses them all. Copies run on a small worker pool;
a copy the runtime refuses is a path failure (the request falls back to shm or
tcp, staged through host memory). Runtime copies cannot be cancelled: a
request that times out may still be copied afterwards.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from daybreak.agent.runtime.base import DeviceBuffer, RuntimeCallError, Unsupported
from daybreak.agent.transfer.batch import Op
from daybreak.agent.transfer.descriptor import DeviceRegion
from daybreak.agent.transfer.transport import (
    Job,
    LocalSegment,
    RemoteSegment,
    Transport,
    TransportHost,
    device_buffer,
)

log = logging.getLogger(__name__)

WORKERS = 4
STRIPE_MIN_BYTES = 8 << 20  # below this one copy call is cheaper than a fan-out


class LinkTransport(Transport):
    name = "link"

    def __init__(self, host: TransportHost, runtime: Any) -> None:
        self.host = host
        self.runtime = runtime
        self.devices = list(runtime.devices())
        self.lanes: dict[tuple[int, int], int] = {}
        for link in runtime.peer_links():
            self.lanes[(link.a, link.b)] = self.lanes[(link.b, link.a)] = int(link.links)
        self.pool = ThreadPoolExecutor(max_workers=WORKERS, thread_name_prefix="link")
        self.stripes = ThreadPoolExecutor(max_workers=WORKERS, thread_name_prefix="link-stripe")
        self.lock = threading.Lock()
        self.opened: list[DeviceBuffer] = []

    # -- registration ---------------------------------------------------------------------------
    def register(self, segment: LocalSegment) -> None:
        if segment.device is None:
            return
        buffer: DeviceBuffer = segment.transport_state["device_buffer"]
        try:
            handle = self.runtime.ipc_handle(buffer).hex()
        except (Unsupported, RuntimeCallError) as exc:
            log.info("link ipc handle unavailable segment=%s cause=%r", segment.segment_id, str(exc))
            handle = ""
        bus = next((d.pci_bus_id for d in self.devices if d.index == segment.device.device), "")
        segment.device_region = DeviceRegion(runtime=self.runtime.name, device=segment.device.device,
                                             pci_bus_id=bus, ipc_handle=handle)

    # -- data path -----------------------------------------------------------------------------
    def supports(self, job: Job) -> bool:
        d = job.remote.descriptor
        if not job.remote.same_node or d.kind != "device":
            return False
        return (d.device is not None and d.device.runtime == self.runtime.name and bool(d.device.ipc_handle)
                and hasattr(self.runtime, "open_ipc_handle"))

    def start(self, jobs: list[Job]) -> None:
        for job in jobs:
            self.pool.submit(self._run, job)

    def _run(self, job: Job) -> None:
        if not job.pending():
            return
        try:
            self._copy(job)
        except (RuntimeCallError, Unsupported, OSError, ValueError) as exc:
            self.host.job_path_failed(job, str(exc), transport=self.name)
            return
        except Exception as exc:
            log.exception("link copy crashed segment=%s", job.remote.segment_id)
            self.host.job_path_failed(job, f"{type(exc).__name__}: {exc}", transport=self.name)
            return
        self.host.job_done(job, transport=self.name)

    def _copy(self, job: Job) -> None:
        remote = self._remote(job.remote)
        local = device_buffer(job) if job.local_device is not None else None
        if local is not None:
            dst, src = (remote, local) if job.op is Op.WRITE else (local, remote)
            dst_off, src_off = ((job.remote_offset, job.local_offset) if job.op is Op.WRITE
                                else (job.local_offset, job.remote_offset))
            self._peer_copy(dst, src, job.length, dst_offset=dst_off, src_offset=src_off)
        elif job.op is Op.WRITE:
            assert job.view is not None
            self.runtime.copy_to_device(remote, job.view, offset=job.remote_offset)
        else:
            assert job.view is not None
            self.runtime.copy_to_host(job.view, remote, offset=job.remote_offset)

    def _peer_copy(self, dst: DeviceBuffer, src: DeviceBuffer, size: int, *, dst_offset: int, src_offset: int) -> None:
        lanes = self.lanes.get((src.device, dst.device), 1)
        if lanes <= 1 or size < STRIPE_MIN_BYTES:
            self.runtime.copy_device(dst, src, size, dst_offset=dst_offset, src_offset=src_offset)
            return
        step = -(-size // lanes)
        futures = [self.stripes.submit(self.runtime.copy_device, dst, src, min(step, size - start),
                                       dst_offset=dst_offset + start, src_offset=src_offset + start)
                   for start in range(0, size, step)]
        for future in futures:
            future.result()  # re-raises the first stripe's error

    def _remote(self, remote: RemoteSegment) -> DeviceBuffer:
        state: DeviceBuffer | None = remote.transport_state.get("link")
        if state is not None:
            return state
        with self.lock:
            state = remote.transport_state.get("link")
            if state is not None:
                return state
            d = remote.descriptor
            assert d.device is not None
            opened: DeviceBuffer = self.runtime.open_ipc_handle(bytes.fromhex(d.device.ipc_handle),
                                                                device=d.device.device, size=d.size)
            self.opened.append(opened)
            remote.transport_state["link"] = opened
            return opened

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.stripes.shutdown(wait=False, cancel_futures=True)
        for buffer in self.opened:
            try:
                self.runtime.close_ipc_handle(buffer)
            except Exception:
                pass
