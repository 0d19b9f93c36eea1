"""The store's data path through the transfer engine: its segments registered and published, and the control ops.

Control vs data (docs/architecture.md): the store protocol says where a
block lives (``XLOCATE``), reserves where it will land (``XALLOC``), publishes
it (``COMMIT``) and ends the reader's lease (``RELEASE``); the bytes move
through the transfer engine, one-sided, into or out of the segments this
module registered: the DRAM tier's /dev/shm segments (shm on this node, rdma
from others) and the HBM tier's device buffer (link: Sunrise Link or CUDA IPC
on this node, GDR over rdma). ``SEGMENTS`` hands a client the descriptors.

A one-sided write lands without the agent seeing the bytes, so COMMIT of an
``XALLOC`` reservation checksums what landed (in the agent's own memory) and
refuses a block whose CRC-32C is not the writer's: the check sits where the
bytes are, once per block, and a writer that cannot checksum its buffer
(device memory) asks the agent to compute it (``FLAG_AGENT_CRC``). The agent
zeroes every extent it hands out this way (``BlockStore.clear``), so that
checksum is of the writer's bytes or of zeros, never of a previous owner's.

One-sided access is granted per block: XLOCATE answers a READ capability and
XALLOC a WRITE capability for each extent (``pool/capability.py``), bound to the
connection's scope, the segment, the range and the lease or reservation, and
minted with a key only this process holds. ``authorize`` is what the engine's
tcp server asks before it lands or sends a byte of a store segment: no valid
capability, no access, whatever credential the peer holds (docs/security.md,
"One-sided access: capabilities").
"""

from __future__ import annotations

import logging
import socket
import threading
from typing import Any

from daybreak.agent.store.engine import BlockStore, Reservation
from daybreak.agent.transfer.transport import LocalSegment
from daybreak.pool import capability as cap
from daybreak.pool import protocol as p
from daybreak.pool.checksum import crc32c

log = logging.getLogger(__name__)

TIER_NUMBER = {"dram": 0, "hbm": 1}


class StoreDataPath:
    """Registers one BlockStore's memory with one transfer engine and answers the engine control ops.

    ``engine`` is a started ``daybreak.agent.transfer.TransferEngine``; this object owns neither
    the store nor (unless ``own_engine``) the engine.
    """

    def __init__(self, *, store: BlockStore, engine: Any, own_engine: bool = False) -> None:
        self.store = store
        self.engine = engine
        self.own_engine = own_engine
        self.segments: dict[tuple[str, int], LocalSegment] = {}
        self._agent_crc: dict[int, bool] = {}  # XALLOC reservation id -> the agent computes the CRC
        self._lock = threading.Lock()
        self.preflight: Any = None  # agent.preflight.Preflight, once it ran
        self.authority = cap.Authority()  # this process's capability key: random, never on the wire
        self._store_segments: set[str] = set()  # segment ids only a capability reaches

    # -- registration ------------------------------------------------------------------------------

    def register(self) -> list[p.SegmentEntry]:
        """Register the DRAM segments and the HBM buffer (when there is one); returns what SEGMENTS answers."""
        for index, seg in enumerate(self.store.shm_segments()):
            self.segments[("dram", index)] = self.engine.register_segment(seg, name=seg.name)
        hbm = self.store.hbm
        if hbm is not None:  # one segment per device: a block's extent segment is its device's position
            for index, buffer in enumerate(hbm.buffers):
                self.segments[("hbm", index)] = self.engine.register_segment(
                    buffer, name=f"{self.store.shm_prefix}-hbm-{index}")
        self._store_segments = {seg.segment_id for seg in self.segments.values()}
        self.engine.require_capabilities(self.authorize)
        log.info("event=datapath_registered engine=%s segments=%d transports=%s", self.engine.engine_id,
                 len(self.segments), ",".join(self.engine.transports))
        return self.entries()

    def entries(self) -> list[p.SegmentEntry]:
        return [p.SegmentEntry(TIER_NUMBER[tier], index, seg.descriptor.to_json())
                for (tier, index), seg in self.segments.items()]

    def descriptors(self) -> list[str]:
        """The node's registered segments as descriptor JSON (what the node publishes)."""
        return [seg.descriptor.to_json() for seg in self.segments.values()]

    def close(self) -> None:
        for seg in self.segments.values():
            try:
                self.engine.unregister_segment(seg)
            except KeyError:
                pass
        self.segments.clear()
        if self.own_engine:
            self.engine.close()

    def authorize(self, segment: LocalSegment, *, offset: int, length: int, write: bool, capability: bytes,
                  claim: str) -> str:
        """The engine server's question before a one-sided READ or WRITE: '' to serve it, else why not.

        A store segment needs a capability covering the range with the right, granted to ``claim``
        (the scope the peer proved in its handshake; the pool secret may use anyone's) and still live.
        Any other segment of this engine (the preflight's probes) is reachable with the pool secret only.
        """
        if segment.segment_id not in self._store_segments:
            if claim == cap.ADMIN_CLAIM:
                return ""
            return f"segment {segment.segment_id} is not a store segment: only the pool secret reaches it"
        right = cap.WRITE if write else cap.READ
        return self.authority.check(capability, segment_id=segment.segment_id, offset=offset, length=length,
                                    right=right, claim=claim,
                                    live=lambda grant, r: self.store.grant_live(grant, write=r == cap.WRITE))

    def segment_of(self, tier: str, index: int) -> str:
        seg = self.segments.get((tier, index))
        return seg.segment_id if seg is not None else ""

    # -- handlers -------------------------------------------------------------------------------------

    def handlers(self, service: Any) -> dict[p.Op, Any]:
        """Entries for ``serving.Service.handlers``; COMMIT is wrapped to verify XALLOC reservations first."""
        plain_commit = service.handlers[p.Op.COMMIT]

        def segments(conn: socket.socket, header: p.Header, request: object) -> None:
            service._reply(conn, header.request_id, p.SegmentsReply(self.entries()).encode())

        def xlocate(conn: socket.socket, header: p.Header, request: object) -> None:
            assert isinstance(request, p.KeysRequest)
            if header.flags & p.FLAG_PULL:
                service.pull.pull(request.keys)
            service.admit_hold()  # a lease counts against the connection's cap (security.md, finding 7)
            blocks = self.store.acquire(request.keys, count=True)
            infos: list[p.BlockInfo] = []
            for key, block in zip(request.keys, blocks, strict=True):
                if block is None:
                    infos.append(service._redirect_or_miss(key))
                    continue
                where = "" if block.staged is not None else self.segment_of(block.tier, block.segment)
                # where == '': not in a registered segment (an SSD block staged in plain memory): GET it
                infos.append(p.BlockInfo(p.Status.OK, block.size, block.checksum, where, block.offset))
            for block in blocks:  # handed out for one-sided reads; a staged SSD block goes by GET, counted there
                if block is not None and block.staged is None:
                    service.store.metrics.moved(service.one_sided_transport(block.tier), "read", block.size)
            # acquire() holds each block; the lease takes that hold over until RELEASE (or expiry)
            lease_id = self.store.lease(blocks)
            service.hold_lease(lease_id)
            caps = self._grant(service, infos, rights=cap.READ, grant=lease_id)
            service._reply(conn, header.request_id, p.BlocksReply(infos, lease_id, caps).encode())

        def xalloc(conn: socket.socket, header: p.Header, request: object) -> None:
            assert isinstance(request, p.PutRequest)
            req = request
            tier = "hbm" if req.tier == 1 else "dram"
            budget = service.admit_hold()
            slots: list[Reservation | p.Status] = []
            with service.handoff.admitting() as refused:
                for k, size, c in zip(req.keys, req.sizes, req.checksums, strict=True):
                    if refused:
                        break
                    if budget is not None and size > budget:
                        slots.append(p.Status.FULL)  # this connection's reservation budget, not the tier
                        continue
                    slot = self.store.reserve(k, size, c, tier=tier, pin_seconds=req.pin_seconds)
                    if isinstance(slot, Reservation) and budget is not None:
                        budget -= size
                    slots.append(slot)
            if refused:
                self.store.commit([s for s in slots if isinstance(s, Reservation)], ok=False)
                service._blocks(conn, header, [p.BlockInfo(p.Status.LEAVING) for _ in req.keys])
                return
            self.store.back(slots)
            self.store.clear(slots)  # one-sided writers are not watched: no residue for them to publish
            parked: list[Reservation | None] = [s if isinstance(s, Reservation) else None for s in slots]
            rid = self.store.park(parked)
            service.hold_reservation(rid, sum(r.size for r in parked if r is not None))
            with self._lock:
                self._agent_crc[rid] = bool(header.flags & p.FLAG_AGENT_CRC)
            infos = [p.BlockInfo(p.Status.OK, s.size, s.checksum, self.segment_of(s.tier, s.segment), s.offset)
                     if isinstance(s, Reservation) else p.BlockInfo(s) for s in slots]
            caps = self._grant(service, infos, rights=cap.WRITE, grant=rid)
            service._reply(conn, header.request_id, p.BlocksReply(infos, rid, caps).encode())

        def commit(conn: socket.socket, header: p.Header, request: object) -> None:
            assert isinstance(request, p.LeaseRequest)
            with self._lock:
                agent_crc = self._agent_crc.pop(request.lease_id, None)
            if agent_crc is None or header.flags & p.FLAG_ABORT:
                plain_commit(conn, header, request)  # ALLOC (same-node memcpy) or an abort
                return
            # Only the connection that reserved may commit (ids of other connections are unknown here).
            parked = (self.store.unpark(request.lease_id) or []) if service.owns_reservation(request.lease_id) else []
            good: list[Reservation] = []
            bad: list[Reservation] = []
            statuses: list[p.Status] = []
            for res in parked:
                if res is None:
                    statuses.append(p.Status.MISS)
                    continue
                crc = self._landed_crc(res)
                if agent_crc and res.cleared:
                    # The agent's own checksum of what landed: safe only over an extent cleared at hand-out
                    # (what was never written reads as zeros, never as the previous owner's bytes).
                    res.checksum = crc
                if crc != res.checksum:
                    log.warning("event=block_refused key=%s reason=checksum_mismatch_after_transfer", res.key)
                    bad.append(res)
                    statuses.append(p.Status.CORRUPT)
                else:
                    good.append(res)
                    statuses.append(p.Status.OK)
            self.store.commit(bad, ok=False)
            self.store.commit(good)
            for res in good:  # the one-sided writes that landed
                service.store.metrics.moved(service.one_sided_transport(res.tier), "write", res.size)
            if header.flags & p.FLAG_RECORD and good:
                service.records.send_later([r.key for r in good])
            service._blocks(conn, header, [p.BlockInfo(s, r.size if r else 0, r.checksum if r else 0)
                                           for s, r in zip(statuses, parked, strict=True)])

        return {p.Op.SEGMENTS: segments, p.Op.XLOCATE: xlocate, p.Op.XALLOC: xalloc, p.Op.COMMIT: commit}

    def _grant(self, service: Any, infos: list[p.BlockInfo], *, rights: int, grant: int) -> list[bytes]:
        """One capability per block in a registered segment, bound to the asking connection's scope."""
        session = getattr(service._local, "session", None)
        claim = session.scope.claim if session is not None else cap.ADMIN_CLAIM  # in-process callers: admin
        expires = self.store.grant_deadline(grant)
        return [self.authority.mint(segment_id=i.where, offset=i.offset, length=i.size, rights=rights, grant=grant,
                                    expires=expires, claim=claim)
                if i.status == p.Status.OK and i.where else b"" for i in infos]

    def _landed_crc(self, res: Reservation) -> int:
        view = self.store.write_buffer(res)  # DRAM in place; HBM: a host buffer to copy into
        if res.tier == "hbm" and self.store.hbm is not None:
            self.store.hbm.read_into(res.segment, res.offset, view)
        return crc32c(view)
