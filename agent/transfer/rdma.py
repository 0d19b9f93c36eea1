"""The rdma transport: pyverbs RC queue pairs per NIC pair, RDMA WRITE/READ striped across ranked NICs.

Written against the pyverbs API surface (rdma-core; Debian ``python3-pyverbs``)
and unit-tested against a fake of that surface; it has NOT run on RDMA
hardware (this project's machines have none). Shape:

- one ``_Nic`` per usable local device: Context, PD, one CQ and a poller thread;
- every registered segment gets an MR on every NIC; its descriptor lists
  ``(nic, gid, lid, addr, rkey)`` per NIC;
- the first request to a peer engine creates one RC queue pair per NIC pair
  (local NIC i with the peer's NIC i, cycling the shorter list), exchanges
  qp numbers, PSNs, GIDs and LIDs over the peer's tcp server (an
  ``RDMA_CONNECT`` frame) and moves both ends INIT -> RTR -> RTS;
- a request is cut into slices; ``paths.plan`` puts each slice on a NIC
  (host memory: round-robin over live NICs; device memory: the device's GDR
  NICs when the device range is registered (GPUDirect: dma-buf or peer
  memory), else staged over the device link to a device that has one, else
  through a chunk of the engine's pinned, NIC-registered staging pool: one
  D2H DMA per slice, no registration per move); a slice
  whose completion fails marks its queue pair dead (moved to ERR, which
  flushes the rest) and is posted again on another NIC; a request that runs
  out of NICs or attempts fails over to tcp;
- at a batch deadline the queue pairs carrying its slices are moved to ERR so
  the NIC stops touching the caller's buffers.

pyverbs names used: device.get_device_list/Context(query_port, query_gid),
pd.PD, mr.MR/DmaBufMR, cq.CQ(poll), qp.QPCap/QPInitAttr/QPAttr/QP(to_rts,
modify, post_send, qp_num), addr.GID/GlobalRoute/AHAttr, wr.SGE/SendWR
(set_wr_rdma) and the IBV_* constants, all through the one shim ``daybreak.agent.runtime.verbs``
(pyverbs.libibverbs_enums in rdma-core v59+, pyverbs.enums before).
"""

from __future__ import annotations

import ctypes
import itertools
import logging
import random
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from daybreak.agent.runtime.verbs import TRANSPORT_MODULES, RdmaUnavailable, Verbs, enum
from daybreak.agent.transfer import metrics, wire
from daybreak.agent.transfer.batch import BatchHandle, Op
from daybreak.agent.transfer.control import control_request
from daybreak.agent.transfer.descriptor import NicRegion
from daybreak.agent.transfer.paths import NoPath, Placement, SliceSpec, TopologyView, plan
from daybreak.agent.transfer.staging import Chunk
from daybreak.agent.transfer.transport import Job, LocalSegment, Transport, TransportHost
from daybreak.errors import DaybreakError

log = logging.getLogger(__name__)

__all__ = ["RdmaTransport", "RdmaUnavailable", "enum", "load_pyverbs"]

SQ_DEPTH = 128  # work requests in flight per queue pair
CQ_DEPTH = 4096
SLICE_BYTES = 1 << 20
MAX_ATTEMPTS = 3
CONNECT_TIMEOUT_S = 5.0


def load_pyverbs() -> Verbs:
    """The pyverbs modules the transport uses, with the enum module of whichever rdma-core is installed."""
    return Verbs.load(modules=TRANSPORT_MODULES)


@dataclass(slots=True, eq=False)
class _Count:
    """Slices of one job still outstanding on rdma (its own object: a job that fell back to tcp
    gets a new ``job.state`` there, and stragglers from here must not count down tcp's)."""

    left: int


@dataclass(slots=True, eq=False)
class _Slice:
    job: Job
    count: _Count
    offset: int  # within the job
    length: int
    attempts: int = 0
    failed: list[str] = field(default_factory=list)  # NICs that failed it
    placement: Placement | None = None
    pair: _Pair | None = None
    staging: Any = None  # a staging-pool chunk (host) or (device buffer, MR) over the link, while staged


class _Nic:
    """One local RDMA device: context, protection domain, completion queue and its poller."""

    def __init__(self, transport: RdmaTransport, name: str, *, port: int) -> None:
        v = transport.verbs
        self.transport = transport
        self.name = name
        self.port = port
        self.ctx = v.device.Context(name=name)
        attr = self.ctx.query_port(port)
        if int(attr.state) != enum(v, "IBV_PORT_ACTIVE"):
            self.ctx.close()
            raise RdmaUnavailable(f"{name} port {port} is not ACTIVE (state {attr.state})")
        self.lid = int(getattr(attr, "lid", 0))
        self.mtu = int(getattr(attr, "active_mtu", enum(v, "IBV_MTU_1024")))
        self.gid_index, self.gid = self._pick_gid()
        self.pd = v.pd.PD(self.ctx)
        self.cq = v.cq.CQ(self.ctx, CQ_DEPTH, None, None, 0)
        self.lock = threading.Lock()
        self.busy = threading.Condition(self.lock)
        self.outstanding: dict[int, _Slice] = {}
        self.closed = False
        self.thread = threading.Thread(target=self._poll_loop, name=f"rdma-poll-{name}", daemon=True)
        self.thread.start()

    def _pick_gid(self) -> tuple[int, str]:
        """Prefer an IPv4-mapped (RoCE v2, routable) GID over link-local ones; skip empty entries."""
        found: list[tuple[int, str]] = []
        for index in range(16):
            try:
                gid = str(self.ctx.query_gid(self.port, index))
            except Exception:
                break
            if gid.replace(":", "").strip("0"):
                found.append((index, gid))
        if not found:
            raise RdmaUnavailable(f"{self.name} port {self.port} has no GID")
        mapped = [g for g in found if g[1].startswith("0000:0000:0000:0000:0000:ffff:")]
        return (mapped or found)[0]

    def _poll_loop(self) -> None:
        backoff = 20e-6
        while True:
            with self.lock:
                while not self.outstanding and not self.closed:
                    self.busy.wait()
                if self.closed:
                    return
            try:
                count, completions = self.cq.poll(32)
            except Exception as exc:  # a CQ in error is fatal for this NIC
                log.error("rdma cq poll failed nic=%s cause=%r", self.name, str(exc))
                self.transport.nic_failed(self, f"completion queue failed: {exc}")
                return
            if count <= 0:
                # adaptive: stay close while completions are due, back off to 1 ms otherwise
                time.sleep(backoff)
                backoff = min(backoff * 2, 1e-3)
                continue
            backoff = 20e-6
            for completion in completions[:count]:
                self.transport.completion(self, completion)

    def close(self) -> None:
        with self.lock:
            self.closed = True
            self.busy.notify_all()
        for obj in (self.cq, self.pd, self.ctx):
            try:
                obj.close()
            except Exception:
                pass


class _Pair:
    """An RC queue pair from one of our NICs to one NIC of a peer engine."""

    def __init__(self, nic: _Nic, remote_nic: str, qp: Any, psn: int) -> None:
        self.nic = nic
        self.remote_nic = remote_nic
        self.qp = qp
        self.psn = psn
        self.alive = False
        self.inflight = 0
        self.backlog: deque[_Slice] = deque()

    def __repr__(self) -> str:
        return f"_Pair({self.nic.name}->{self.remote_nic}, alive={self.alive})"


class _Peer:
    def __init__(self, engine_id: str) -> None:
        self.engine_id = engine_id
        self.pairs: list[_Pair] = []
        self.lock = threading.Lock()

    def live(self) -> list[_Pair]:
        return [p for p in self.pairs if p.alive]


class RdmaTransport(Transport):
    name = "rdma"

    def __init__(self, host: TransportHost, *, verbs: Any = None, topology: Any = None, runtime: Any = None,
                 nics: list[str] | None = None, port: int = 1) -> None:
        self.host = host
        self.verbs = verbs if verbs is not None else load_pyverbs()
        self.runtime = runtime
        if isinstance(topology, TopologyView) or topology is None:
            self.view = topology or TopologyView()
        else:
            self.view = TopologyView.from_topology(topology)
        try:
            found = [d.name.decode() if isinstance(d.name, bytes) else str(d.name)
                     for d in self.verbs.device.get_device_list()]
        except Exception as exc:  # pyverbs raises PyverbsRDMAError('Failed to get devices list')
            raise RdmaUnavailable(f"no RDMA devices: {exc}") from None
        wanted = nics or self.view.nics or found
        self.nics: dict[str, _Nic] = {}
        skipped: list[str] = []
        for name in wanted:
            if name not in found:
                skipped.append(f"{name}: not present")
                continue
            try:
                self.nics[name] = _Nic(self, name, port=port)
            except RdmaUnavailable as exc:
                skipped.append(str(exc))
            except Exception as exc:
                skipped.append(f"{name}: {exc}")
        if not self.nics:
            raise RdmaUnavailable("no usable RDMA device" + (f" ({'; '.join(skipped)})" if skipped else ""))
        if not self.view.nics:
            self.view.nics = list(self.nics)
        for reason in skipped:
            log.info("rdma nic skipped cause=%r", reason)
        v = self.verbs
        self.access = (enum(v, "IBV_ACCESS_LOCAL_WRITE") | enum(v, "IBV_ACCESS_REMOTE_WRITE")
                       | enum(v, "IBV_ACCESS_REMOTE_READ"))
        self.peers: dict[str, _Peer] = {}
        self.accepted: dict[str, list[Any]] = {}
        self.lock = threading.Lock()
        self.ids = itertools.count(1)
        log.info("rdma transport up nics=%s", ",".join(f"{n.name}(gid={n.gid})" for n in self.nics.values()))

    # -- registration ------------------------------------------------------------------------
    def register(self, segment: LocalSegment) -> None:
        mrs: dict[str, Any] = {}
        regions: list[NicRegion] = []
        for nic in self.nics.values():
            try:
                mr, base = self._register_memory(nic, segment)
            except Exception as exc:
                log.warning("rdma registration failed segment=%s nic=%s cause=%r", segment.segment_id, nic.name,
                            str(exc))
                continue
            mrs[nic.name] = (mr, base)
            regions.append(NicRegion(nic=nic.name, port=nic.port, gid=nic.gid, lid=nic.lid, addr=base,
                                     rkey=int(mr.rkey)))
        segment.transport_state["rdma"] = mrs
        segment.nic_regions = tuple(regions)

    def _register_memory(self, nic: _Nic, segment: LocalSegment) -> tuple[Any, int]:
        """MR over host memory, or over device memory: dma-buf (IOVA = offset 0) when the runtime exports
        one, else the device address itself (peer-memory client)."""
        v = self.verbs
        if segment.device is not None and self.runtime is not None and hasattr(v.mr, "DmaBufMR"):
            try:
                fd = self.runtime.export_dmabuf(segment.transport_state.get("device_buffer", segment.device))
            except Exception:
                fd = -1
            if fd >= 0:
                return v.mr.DmaBufMR(nic.pd, segment.size, self.access, dmabuf=fd, offset=0), 0
        if segment.address == 0:
            raise ValueError("segment memory has no address (read-only buffer)")
        return v.mr.MR(nic.pd, segment.size, self.access, address=segment.address), segment.address

    def unregister(self, segment: LocalSegment) -> None:
        for mr, _ in segment.transport_state.pop("rdma", {}).values():
            try:
                mr.close()
            except Exception:
                pass

    # -- connection set-up -----------------------------------------------------------------------
    def _new_qp(self, nic: _Nic) -> tuple[Any, int]:
        v = self.verbs
        cap = v.qp.QPCap(max_send_wr=SQ_DEPTH, max_recv_wr=1, max_send_sge=1, max_recv_sge=1)
        init = v.qp.QPInitAttr(qp_type=enum(v, "IBV_QPT_RC"), scq=nic.cq, rcq=nic.cq, cap=cap)
        attr = v.qp.QPAttr(port_num=nic.port)
        attr.qp_access_flags = self.access
        qp = v.qp.QP(nic.pd, init, attr)  # created in INIT
        return qp, random.randrange(1 << 24)

    def _to_rts(self, nic: _Nic, qp: Any, *, psn: int, remote: dict[str, Any]) -> None:
        v = self.verbs
        attr = v.qp.QPAttr(port_num=nic.port)
        attr.qp_access_flags = self.access
        attr.path_mtu = min(nic.mtu, int(remote.get("mtu", nic.mtu)))
        attr.dest_qp_num = int(remote["qpn"])
        attr.rq_psn = int(remote["psn"])
        attr.sq_psn = psn
        attr.max_dest_rd_atomic = 16
        attr.max_rd_atomic = 16
        attr.min_rnr_timer = 12
        attr.timeout = 14  # 4.096 us * 2^14 = 67 ms per try, 7 tries: a dead NIC shows within 0.5 s
        attr.retry_cnt = 7
        attr.rnr_retry = 7
        route = v.addr.GlobalRoute(dgid=v.addr.GID(val=remote["gid"]), sgid_index=nic.gid_index)
        attr.ah_attr = v.addr.AHAttr(port_num=nic.port, is_global=1, gr=route, dlid=int(remote.get("lid", 0)))
        qp.to_rts(attr)

    def _endpoint_info(self, nic: _Nic, qp: Any, psn: int) -> dict[str, Any]:
        return {"qpn": int(qp.qp_num), "psn": psn, "gid": nic.gid, "lid": nic.lid, "mtu": nic.mtu}

    def _connect(self, peer: _Peer, job: Job) -> None:
        """Create queue pairs to every NIC the peer's segment is registered on, over its tcp server."""
        d = job.remote.descriptor
        remote_nics = [r.nic for r in d.rdma]
        local = list(self.nics.values())
        count = max(len(local), len(remote_nics))
        fresh: list[_Pair] = []
        offers = []
        for i in range(count):
            nic, remote_nic = local[i % len(local)], remote_nics[i % len(remote_nics)]
            qp, psn = self._new_qp(nic)
            fresh.append(_Pair(nic, remote_nic, qp, psn))
            offers.append({"local_nic": nic.name, "remote_nic": remote_nic, **self._endpoint_info(nic, qp, psn)})
        timeout = min(CONNECT_TIMEOUT_S, max(0.05, job.batch.deadline - time.monotonic()))
        try:
            answer = control_request(d.tcp_endpoint, wire.FrameType.RDMA_CONNECT,
                                     {"engine_id": self.host.engine_id, "pairs": offers},
                                     engine_id=self.host.engine_id, token=self.host.token, timeout_s=timeout,
                                     tls=self.host.tls)
            accepted = answer["pairs"]
            if len(accepted) != len(fresh):
                raise OSError(f"peer accepted {len(accepted)} of {len(fresh)} queue pairs")
            for pair, remote in zip(fresh, accepted, strict=True):
                self._to_rts(pair.nic, pair.qp, psn=pair.psn, remote=remote)
                pair.alive = True
        except Exception:
            for pair in fresh:
                _close(pair.qp)
            raise
        old = [p for p in peer.pairs if not p.alive]
        peer.pairs = [p for p in peer.pairs if p.alive] + fresh
        for pair in old:
            _close(pair.qp)
        log.info("rdma connected peer=%s pairs=%s", peer.engine_id,
                 ",".join(f"{p.nic.name}->{p.remote_nic}" for p in fresh))

    def accept(self, request: dict[str, Any]) -> dict[str, Any]:
        """Server side of RDMA_CONNECT: one queue pair per offered pair, moved to RTS with the offer."""
        engine_id = str(request.get("engine_id", ""))
        answers = []
        made: list[Any] = []
        try:
            for offer in request["pairs"]:
                nic = self.nics.get(offer["remote_nic"])
                if nic is None:
                    raise ValueError(f"no NIC {offer['remote_nic']!r} here")
                qp, psn = self._new_qp(nic)
                made.append(qp)
                self._to_rts(nic, qp, psn=psn, remote=offer)
                answers.append(self._endpoint_info(nic, qp, psn))
        except Exception:
            for qp in made:
                _close(qp)
            raise
        with self.lock:
            # a peer that reconnects replaces its old queue pairs
            for qp in self.accepted.pop(engine_id, []):
                _close(qp)
            self.accepted[engine_id] = made
        return {"pairs": answers}

    # -- data path -------------------------------------------------------------------------------
    def supports(self, job: Job) -> bool:
        if not job.remote.descriptor.rdma or not job.remote.descriptor.tcp_endpoint:
            return False
        if job.view is None and job.local_device is not None and self.runtime is not None:
            return True  # device memory: GPUDirect where registered and the topology allows, else staged
        return self._local(job) is not None

    def _local(self, job: Job) -> tuple[LocalSegment, int] | None:
        """The registered segment holding the job's local bytes and the offset of byte 0 in it."""
        if job.local_segment is not None and "rdma" in job.local_segment.transport_state:
            return job.local_segment, job.local_offset
        if job.view is None and job.local_device is not None:  # device memory registered as a segment
            ptr, device = job.local_device.ptr + job.local_offset, job.local_device.device
            for segment in self.host.local_segments():
                d = segment.device
                if d is not None and d.device == device and "rdma" in segment.transport_state \
                        and d.ptr <= ptr and ptr + job.length <= d.ptr + d.size:
                    return segment, ptr - d.ptr
            return None
        if job.view is None or job.view.readonly:
            return None
        address = ctypes.addressof(ctypes.c_char.from_buffer(job.view))
        for segment in self.host.local_segments():
            if segment.buffer is not None and "rdma" in segment.transport_state:
                if segment.address <= address and address + job.length <= segment.address + segment.size:
                    return segment, address - segment.address
        return None

    def start(self, jobs: list[Job]) -> None:
        for job in jobs:
            peer = self._peer(job.peer)
            try:
                with peer.lock:
                    if not peer.live():
                        self._connect(peer, job)
            except Exception as exc:
                self.host.job_path_failed(job, f"queue-pair set-up with {job.peer} failed: {exc}", transport=self.name)
                continue
            count = _Count((job.length + SLICE_BYTES - 1) // SLICE_BYTES)
            slices = [_Slice(job, count, off, min(SLICE_BYTES, job.length - off))
                      for off in range(0, job.length, SLICE_BYTES)]
            job.state = count
            self._place(peer, slices)

    def _peer(self, engine_id: str) -> _Peer:
        with self.lock:
            peer = self.peers.get(engine_id)
            if peer is None:
                peer = self.peers[engine_id] = _Peer(engine_id)
            return peer

    def _place(self, peer: _Peer, slices: list[_Slice]) -> None:
        live = peer.live()
        by_nic: dict[str, list[_Pair]] = {}
        for pair in live:
            by_nic.setdefault(pair.nic.name, []).append(pair)
        specs = [SliceSpec(x, x.job.local_device.device if x.job.local_device is not None else None) for x in slices]
        try:
            placements = plan(specs, view=self.view, live=list(by_nic), exclude={x: x.failed for x in slices})
        except NoPath as exc:
            for x in slices:
                self._give_up(x, str(exc))
            return
        cursor: dict[str, int] = {}
        for placement in placements:
            s: _Slice = placement.key
            if (s.job.local_device is not None and placement.stage_device is None and not placement.stage_host
                    and self._local(s.job) is None):
                # a GDR NIC, but the device range is not registered with it: stage instead of failing
                placement = Placement(s, placement.nic, stage_host=True)
            pairs = by_nic[placement.nic]
            i = cursor.get(placement.nic, 0)
            cursor[placement.nic] = i + 1
            s.placement = placement
            self._post(pairs[i % len(pairs)], s)

    def _post(self, pair: _Pair, s: _Slice) -> None:
        s.pair = pair
        s.attempts += 1
        nic = pair.nic
        with nic.lock:
            if pair.inflight >= SQ_DEPTH:
                pair.backlog.append(s)
                return
            pair.inflight += 1
        self._post_now(pair, s)

    def _post_now(self, pair: _Pair, s: _Slice) -> None:
        v = self.verbs
        nic = pair.nic
        job = s.job
        try:
            if not job.pending():
                raise _Skip()
            region = next(r for r in job.remote.descriptor.rdma if r.nic == pair.remote_nic)
            if s.placement is not None and (s.placement.stage_device is not None or s.placement.stage_host):
                laddr, lkey = self._stage_out(s, nic)
            else:
                local = self._local(job)
                if local is None:
                    raise RuntimeError("local memory is no longer registered")
                segment, base = local
                mr, mr_base = segment.transport_state["rdma"][nic.name]
                laddr = mr_base + base + s.offset
                lkey = int(mr.lkey)
            wr_id = next(self.ids)
            opcode = enum(v, "IBV_WR_RDMA_WRITE" if job.op is Op.WRITE else "IBV_WR_RDMA_READ")
            wr = v.wr.SendWR(wr_id=wr_id, opcode=opcode, num_sge=1, sg=[v.wr.SGE(laddr, s.length, lkey)],
                             send_flags=enum(v, "IBV_SEND_SIGNALED"))
            wr.set_wr_rdma(int(region.rkey), int(region.addr) + job.remote_offset + s.offset)
            with nic.lock:
                nic.outstanding[wr_id] = s
                nic.busy.notify()
            try:
                pair.qp.post_send(wr)
            except Exception:
                with nic.lock:
                    nic.outstanding.pop(wr_id, None)
                raise
        except _Skip:
            self._release(pair)
        except Exception as exc:
            self._release(pair)
            self._pair_failed(pair, f"post_send failed: {exc}")
            self._retry(s, f"{nic.name}->{pair.remote_nic}: post_send failed: {exc}")

    def _release(self, pair: _Pair) -> None:
        nic = pair.nic
        with nic.lock:
            pair.inflight -= 1
            follow = pair.backlog.popleft() if pair.backlog and pair.alive else None
            if follow is not None:
                pair.inflight += 1
        if follow is not None:
            self._post_now(pair, follow)

    def completion(self, nic: _Nic, wc: Any) -> None:
        """Called by the NIC's poller for every work completion."""
        with nic.lock:
            s = nic.outstanding.pop(int(wc.wr_id), None)
        if s is None:
            return
        pair = s.pair
        assert pair is not None
        self._release(pair)
        if int(wc.status) == enum(self.verbs, "IBV_WC_SUCCESS"):
            if s.staging is not None:
                try:
                    self._stage_in(s)
                except Exception as exc:  # the runtime refused the copy back: the request fails over
                    self._free_staging(s)
                    self._give_up(s, f"copy from staging into device memory failed: {exc}")
                    return
            self._slice_done(s)
            return
        cause = f"{nic.name}->{pair.remote_nic}: work completion status {int(wc.status)}"
        self._pair_failed(pair, cause)
        self._retry(s, cause)

    def _slice_done(self, s: _Slice) -> None:
        job = s.job
        with self.lock:
            s.count.left -= 1
            finished = s.count.left == 0 and job.state is s.count
        if finished:
            self.host.job_done(job, transport=self.name)

    def _retry(self, s: _Slice, cause: str) -> None:
        self._free_staging(s)
        if s.pair is not None:
            s.failed.append(s.pair.nic.name)
        job = s.job
        if not job.pending():
            return
        if s.attempts >= MAX_ATTEMPTS or time.monotonic() >= job.batch.deadline:
            self._give_up(s, cause)
            return
        metrics.RETRIES.labels("rdma").inc()
        log.info("rdma slice retried on another nic job=%s offset=%d cause=%r", job.remote.segment_id,
                 s.offset, cause)
        self._place(self._peer(job.peer), [s])

    def _give_up(self, s: _Slice, cause: str) -> None:
        if s.job.pending():
            self.host.job_path_failed(s.job, cause, transport=self.name)

    def _pair_failed(self, pair: _Pair, cause: str) -> None:
        if not pair.alive:
            return
        pair.alive = False
        log.warning("rdma queue pair failed nic=%s remote_nic=%s cause=%r", pair.nic.name, pair.remote_nic, cause)
        self._to_error(pair)
        backlog: list[_Slice] = []
        with pair.nic.lock:
            while pair.backlog:
                backlog.append(pair.backlog.popleft())
                pair.inflight -= 1 if pair.inflight > 0 else 0
        for s in backlog:
            self._retry(s, cause)

    def _to_error(self, pair: _Pair) -> None:
        """Move the QP to ERR: the NIC flushes its outstanding work and stops touching our buffers."""
        v = self.verbs
        try:
            pair.qp.modify(v.qp.QPAttr(qp_state=enum(v, "IBV_QPS_ERR")), enum(v, "IBV_QP_STATE"))
        except Exception as exc:
            log.debug("rdma qp to ERR failed nic=%s cause=%r", pair.nic.name, str(exc))

    def nic_failed(self, nic: _Nic, cause: str) -> None:
        for peer in list(self.peers.values()):
            for pair in peer.pairs:
                if pair.nic is nic:
                    self._pair_failed(pair, cause)
        with nic.lock:
            stranded = list(nic.outstanding.values())
            nic.outstanding.clear()
        for s in stranded:
            self._retry(s, cause)

    def abort(self, batch: BatchHandle) -> None:
        for nic in self.nics.values():
            with nic.lock:
                pairs = {id(s.pair): s.pair for s in nic.outstanding.values()
                         if s.job.batch is batch and s.pair is not None}
            for pair in pairs.values():
                self._pair_failed(pair, "batch deadline passed")

    # -- staging for device memory without a GDR path -----------------------------------------------
    def _stage_out(self, s: _Slice, nic: _Nic) -> tuple[int, int]:
        """Give the NIC registered bytes for a slice of device memory it cannot reach directly."""
        placement = s.placement
        assert placement is not None
        job = s.job
        if self.runtime is None or job.local_device is None:
            raise RuntimeError("staging needs the accelerator runtime")
        if placement.stage_host:
            # a chunk of the engine's staging pool: pinned and registered with every NIC when its area was made
            chunk = self.host.staging.take(s.length, transport=self.name)
            s.staging = chunk
            registered = chunk.segment.transport_state.get("rdma", {}).get(nic.name)
            if registered is None:
                raise RuntimeError(f"the staging area is not registered with {nic.name}")
            area_mr, area_base = registered
            metrics.STAGED_BYTES.labels(self.name).inc(s.length)
            if job.op is Op.WRITE:
                self._device_copy(s, to_staging=True)
            return area_base + chunk.offset, int(area_mr.lkey)
        assert placement.stage_device is not None
        staging = self.runtime.allocate(placement.stage_device, s.length)
        address = int(staging.address)
        mr = self.verbs.mr.MR(nic.pd, s.length, self.access, address=address)
        s.staging = (staging, mr)
        if job.op is Op.WRITE:
            self._device_copy(s, to_staging=True)
        return address, int(mr.lkey)

    def _stage_in(self, s: _Slice) -> None:
        if s.job.op is Op.READ:
            self._device_copy(s, to_staging=False)
        self._free_staging(s)

    def _device_copy(self, s: _Slice, *, to_staging: bool) -> None:
        from daybreak.agent.runtime.base import DeviceBuffer

        job = s.job
        assert job.local_device is not None and self.runtime is not None
        source = DeviceBuffer(job.local_device.device, job.local_device.ptr, job.local_device.size)
        offset = job.local_offset + s.offset
        if isinstance(s.staging, Chunk):
            if to_staging:
                self.runtime.copy_to_host(s.staging.view, source, offset=offset)
            else:
                self.runtime.copy_to_device(source, s.staging.view, offset=offset)
            return
        staging, _ = s.staging
        if to_staging:
            self.runtime.copy_device(staging, source, s.length, src_offset=offset)
        else:
            self.runtime.copy_device(source, staging, s.length, dst_offset=offset)

    def _free_staging(self, s: _Slice) -> None:
        if s.staging is None:
            return
        if isinstance(s.staging, Chunk):
            self.host.staging.give(s.staging)
            s.staging = None
            return
        staging, mr = s.staging
        s.staging = None
        _close(mr)
        if self.runtime is not None:
            self.runtime.free(staging)

    def close(self) -> None:
        for peer in self.peers.values():
            for pair in peer.pairs:
                _close(pair.qp)
        for qps in self.accepted.values():
            for qp in qps:
                _close(qp)
        for nic in self.nics.values():
            nic.close()


class _Skip(DaybreakError):
    """The slice's request already finished (deadline or failure elsewhere): do not post it."""


def _close(obj: Any) -> None:
    try:
        obj.close()
    except Exception:
        pass
