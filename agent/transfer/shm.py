"""The shm transport: same-node peers map each other's /dev/shm segments and a request is one memcpy.

The copy runs in the submitting thread: for the sizes a KV block has, handing
it to another thread costs more than the copy. Mapping failures (the segment
is gone, permissions) are path failures, so requests fall back to tcp.

Device memory on our side (a KV block in HBM) moves as ONE runtime copy, a
device-to-host DMA straight into the mapped segment (host-to-device out of it
on READ): no bounce buffer, no pageable intermediate. The mapping is
page-locked with the runtime (``TransportHost.pin_host``) the first time device
bytes use it, once per mapping, and unpinned before it is unmapped.
"""

from __future__ import annotations

import logging

from daybreak.agent.runtime.base import RuntimeCallError, Unsupported
from daybreak.agent.transfer.batch import Op
from daybreak.agent.transfer.transport import (
    Job,
    RemoteSegment,
    Transport,
    TransportHost,
    address_of,
    device_buffer,
)
from daybreak.pool.shm import ShmSegment

log = logging.getLogger(__name__)


class ShmTransport(Transport):
    name = "shm"

    def __init__(self, host: TransportHost) -> None:
        self._host = host
        self._mapped: list[ShmSegment] = []
        self._pinned: list[int] = []  # addresses of mappings page-locked for device DMA

    def supports(self, job: Job) -> bool:
        if not job.remote.same_node or not job.remote.descriptor.shm_name:
            return False
        return job.view is not None or (job.local_device is not None and self._host.runtime is not None)

    def map(self, remote: RemoteSegment) -> memoryview:
        view = remote.transport_state.get("shm")
        if view is None:
            segment = ShmSegment.attach(remote.descriptor.shm_name)
            if segment.size < remote.size:
                segment.close()
                raise OSError(f"/dev/shm/{remote.descriptor.shm_name} is {segment.size} bytes, "
                              f"descriptor says {remote.size}")
            self._mapped.append(segment)
            view = remote.transport_state["shm"] = segment.buffer
        return view

    def start(self, jobs: list[Job]) -> None:
        done: list[Job] = []
        for job in jobs:
            try:
                mapped = self.map(job.remote)
            except (OSError, ValueError) as exc:
                self._host.job_path_failed(job, f"cannot map /dev/shm/{job.remote.descriptor.shm_name}: {exc}", transport=self.name)
                continue
            start = job.remote_offset
            if job.view is None:
                try:
                    self._device_copy(job, mapped)
                except (RuntimeCallError, Unsupported, ValueError, OSError) as exc:
                    self._host.job_path_failed(job, f"device copy into /dev/shm/{job.remote.descriptor.shm_name} "
                                                    f"failed: {exc}", transport=self.name)
                    continue
            elif job.op is Op.WRITE:
                mapped[start:start + job.length] = job.view
            else:
                job.view[:] = mapped[start:start + job.length]
            done.append(job)
        if done:
            self._host.jobs_done(done, self.name)

    def _device_copy(self, job: Job, mapped: memoryview) -> None:
        """One DMA between the job's device memory and the mapped segment, pinned the first time."""
        if job.remote.transport_state.get("shm_pinned") is None:
            address = address_of(mapped)
            pinned = self._host.pin_host(address, len(mapped))
            if pinned:
                self._pinned.append(address)
            job.remote.transport_state["shm_pinned"] = pinned
        window = mapped[job.remote_offset:job.remote_offset + job.length]
        if job.op is Op.WRITE:
            self._host.runtime.copy_to_host(window, device_buffer(job), offset=job.local_offset)
        else:
            self._host.runtime.copy_to_device(device_buffer(job), window, offset=job.local_offset)

    def close(self) -> None:
        for address in self._pinned:  # unpin before the mappings go
            self._host.unpin_host(address)
        self._pinned.clear()
        for segment in self._mapped:
            try:
                segment.close()
            except BufferError:
                pass  # a caller still holds a view; the mapping goes with the process
        self._mapped.clear()
