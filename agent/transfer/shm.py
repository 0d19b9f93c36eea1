"""The shm transport: same-node peers map each other's /dev/shm segments and a request is one memcpy.

The copy runs in the submitting thread: for the sizes a KV block has, handing
it to another thread costs more than the copy. Mapping failures (the segment
is gone, permissions) are path failures, so requests fall back to tcp.
"""

from __future__ import annotations

import logging

from daybreak.agent.transfer.batch import Op
from daybreak.agent.transfer.transport import Job, RemoteSegment, Transport, TransportHost
from daybreak.pool.shm import ShmSegment

log = logging.getLogger(__name__)


class ShmTransport(Transport):
    name = "shm"

    def __init__(self, host: TransportHost) -> None:
        self._host = host
        self._mapped: list[ShmSegment] = []

    def supports(self, job: Job) -> bool:
        return job.view is not None and job.remote.same_node and bool(job.remote.descriptor.shm_name)

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
            assert job.view is not None
            if job.op is Op.WRITE:
                mapped[start:start + job.length] = job.view
            else:
                job.view[:] = mapped[start:start + job.length]
            done.append(job)
        if done:
            self._host.jobs_done(done, self.name)

    def close(self) -> None:
        for segment in self._mapped:
            try:
                segment.close()
            except BufferError:
                pass  # a caller still holds a view; the mapping goes with the process
        self._mapped.clear()
