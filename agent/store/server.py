"""The agent's store server: authenticated connections, request dispatch, pool membership and handoff.

One thread per connection with blocking sockets: ``recv_into`` and
``sendmsg`` release the GIL, so bytes move at socket speed while the index
work stays short under the store's lock. A connection that sends a bad
token, a malformed or oversized frame is closed with a logged reason; no
other connection notices.

Membership is masterless: every agent pings the peers it knows (the static
``--peers`` list, or the pool's published endpoints) and learns new ones
from their replies. An agent that leaves marks itself leaving, hands each
block to the key's new homes among the others, and only then stops.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import secrets
import socket
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from daybreak.agent.store.engine import Block, BlockStore, Reservation
from daybreak.pool import protocol as p
from daybreak.pool.checksum import crc32c
from daybreak.pool.connection import Connection, parse_address
from daybreak.pool.handshake import AuthenticationFailed, Hello, server_accept
from daybreak.pool.placement import rank
from daybreak.pool.shm import ShmSegment
from daybreak.pool.sockets import discard, recv_exact_into, send_all

log = logging.getLogger("daybreak.store.server")

HEARTBEAT_SECONDS = 0.5
DEAD_AFTER_FAILURES = 2
HANDOFF_BATCH = 32
MAX_POINTERS = 1 << 20  # records of blocks held elsewhere (local-first writes), oldest dropped first


@dataclass
class Peer:
    address: str
    agent_id: str = ""
    live: bool = False
    leaving: bool = False
    failures: int = 0
    last_seen: float = 0.0


class PeerPool:
    """Idle connections to other agents, borrowed one request at a time."""

    def __init__(self, token: bytes, agent_id: str) -> None:
        self.token = token
        self.agent_id = agent_id
        self._idle: dict[str, list[Connection]] = {}
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def borrow(self, address: str, *, timeout_seconds: float = 10.0) -> Iterator[Connection]:
        with self._lock:
            idle = self._idle.setdefault(address, [])
            conn = idle.pop() if idle else None
        if conn is None:
            conn = Connection(address, token=self.token, timeout_seconds=timeout_seconds, client=self.agent_id)
        try:
            yield conn
        except BaseException:
            conn.close()
            raise
        with self._lock:
            self._idle.setdefault(address, []).append(conn)

    def drop(self, address: str) -> None:
        with self._lock:
            for conn in self._idle.pop(address, []):
                conn.close()

    def close(self) -> None:
        with self._lock:
            for conns in self._idle.values():
                for conn in conns:
                    conn.close()
            self._idle.clear()


class StoreServer:
    """Serves one BlockStore on ``listen`` for the pool that shares ``token``."""

    def __init__(self, store: BlockStore, *, listen: str, token: bytes, pool: str, advertise: str = "",
                 peers: list[str] | None = None, replicas: int = 1, lease_seconds: int = 10) -> None:
        self.store = store
        self.token = token
        self.pool = pool
        self.replicas = replicas
        self.lease_seconds = lease_seconds
        host, port = parse_address(listen)
        self.sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.sock.listen(128)
        bound_port = self.sock.getsockname()[1]
        self.address = advertise or f"{host if host not in ('0.0.0.0', '::') else socket.gethostname()}:{bound_port}"
        self.agent_id = self.address
        self.leaving = False
        self._closed = threading.Event()
        self._peers: dict[str, Peer] = {}
        self._peers_lock = threading.Lock()
        for address in peers or []:
            if address and address != self.address:
                self._peers[address] = Peer(address)
        self.pool_conns = PeerPool(token, self.agent_id)
        self._conns: set[socket.socket] = set()
        self._conns_lock = threading.Lock()
        self.nonce = secrets.token_bytes(16)
        self.probe = ShmSegment.create(f"{store.dram.prefix}-probe", 4096, exist_ok=True)
        self.probe.buffer[:16] = self.nonce
        self._threads: list[threading.Thread] = []
        # Held from "am I leaving?" to "space reserved", so leave() never snapshots between the two.
        self._admission = threading.Lock()
        self.pointers: OrderedDict[str, str] = OrderedDict()  # key -> address of the agent holding it
        self._pointers_lock = threading.Lock()
        self._records: queue.Queue[list[str]] = queue.Queue()

    # -- lifecycle ------------------------------------------------------------------------------

    def start(self) -> None:
        for target, name in ((self._accept_loop, "store-accept"), (self._heartbeat_loop, "store-heartbeat"),
                             (self._maintenance_loop, "store-maintenance"), (self.store.dram.prefault, "store-prefault"),
                             (self._record_loop, "store-record")):
            t = threading.Thread(target=target, name=name, daemon=True)
            t.start()
            self._threads.append(t)
        if self._peers:
            self._heartbeat_once()

    def close(self) -> None:
        """Stop serving (blocks stay in /dev/shm for the next start to re-adopt)."""
        self._closed.set()
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
        with self._conns_lock:
            for conn in list(self._conns):
                with contextlib.suppress(OSError):
                    conn.shutdown(socket.SHUT_RDWR)
        for t in self._threads:
            t.join(timeout=5)
        self.pool_conns.close()
        with contextlib.suppress(BufferError):
            self.probe.close()

    # -- membership -----------------------------------------------------------------------------

    def me(self) -> p.Member:
        return p.Member(self.agent_id, self.address, 1 if self.leaving else 0)

    def members(self) -> list[p.Member]:
        """Live, serving agents as this agent sees them (itself included unless leaving)."""
        out = [] if self.leaving else [self.me()]
        with self._peers_lock:
            out += [p.Member(x.agent_id or x.address, x.address, 0) for x in self._peers.values()
                    if x.live and not x.leaving]
        return out

    def live_ids(self, *, include_self: bool = True) -> list[str]:
        return [m.agent_id for m in self.members() if include_self or m.agent_id != self.agent_id]

    def _address_of(self, agent_id: str) -> str:
        with self._peers_lock:
            for x in self._peers.values():
                if (x.agent_id or x.address) == agent_id:
                    return x.address
        return agent_id

    def set_peers(self, addresses: list[str]) -> None:
        """Replace the peer list (in a cluster: the pool's published endpoints); new ones are pinged next tick."""
        wanted = {a for a in addresses if a and a != self.address}
        with self._peers_lock:
            for gone in set(self._peers) - wanted:
                del self._peers[gone]
            for address in wanted - set(self._peers):
                self._peers[address] = Peer(address)

    def _heard(self, member: p.Member) -> None:
        if member.address == self.address:
            return
        with self._peers_lock:
            peer = self._peers.setdefault(member.address, Peer(member.address))
            was_live = peer.live and not peer.leaving
            peer.agent_id, peer.leaving, peer.live = member.agent_id, bool(member.state), True
            peer.failures, peer.last_seen = 0, time.monotonic()
        if not was_live and not member.state:
            log.info("event=peer_joined agent=%s peer=%s", self.agent_id, member.address)

    def _heartbeat_once(self) -> None:
        with self._peers_lock:
            addresses = list(self._peers)
        for address in addresses:
            try:
                with self.pool_conns.borrow(address, timeout_seconds=2.0) as conn:
                    view = conn.ping(self.me())
                for member in view:
                    if member.address == address or member.address not in self._peers:
                        self._heard(member)
            except Exception as exc:  # any failure counts as a missed heartbeat
                with self._peers_lock:
                    peer = self._peers.get(address) or Peer(address)  # may have been removed meanwhile
                    peer.failures += 1
                    if peer.live and peer.failures >= DEAD_AFTER_FAILURES:
                        peer.live = False
                        log.warning("event=peer_lost agent=%s peer=%s reason=%s", self.agent_id, address,
                                    str(exc) or type(exc).__name__)
                self.pool_conns.drop(address)

    def _heartbeat_loop(self) -> None:
        while not self._closed.wait(HEARTBEAT_SECONDS):
            self._heartbeat_once()

    # -- local-first records --------------------------------------------------------------------

    def _record_loop(self) -> None:
        """Tell each key's home that this agent holds it, off the writer's critical path."""
        while not self._closed.is_set():
            try:
                keys = self._records.get(timeout=0.5)
            except queue.Empty:
                continue
            live = self.live_ids()
            by_home: dict[str, list[str]] = {}
            for key in keys:
                home = rank(key, live)[0] if live else self.agent_id
                if home != self.agent_id:
                    by_home.setdefault(home, []).append(key)
            for home, group in by_home.items():
                try:
                    with self.pool_conns.borrow(self._address_of(home), timeout_seconds=5.0) as conn:
                        conn.record(self.address, group)
                except Exception as exc:  # the block is still found by pull-through, just a hop later
                    log.info("event=record_failed agent=%s home=%s keys=%d reason=%s", self.agent_id, home,
                             len(group), exc)

    def _note(self, holder: str, keys: list[str]) -> None:
        held = self.store.exists(keys)
        with self._pointers_lock:
            for key, block in zip(keys, held, strict=True):
                if block is None and holder != self.address:
                    self.pointers[key] = holder
                    self.pointers.move_to_end(key)
            while len(self.pointers) > MAX_POINTERS:
                self.pointers.popitem(last=False)

    def _pointer(self, key: str) -> str | None:
        with self._pointers_lock:
            return self.pointers.get(key)

    def _maintenance_loop(self) -> None:
        while not self._closed.wait(0.5):
            self.store.expire()
            self.store.maybe_compact()

    # -- leaving ----------------------------------------------------------------------------------

    def leave(self) -> int:
        """Hand every block to its new homes among the remaining agents; returns blocks moved."""
        with self._admission:
            self.leaving = True
        self._heartbeat_once()  # tell the peers now rather than at the next tick
        # Writes accepted before we started leaving must land before the snapshot below,
        # or they would be left behind; new ones are already refused (LEAVING).
        deadline = time.monotonic() + self.lease_seconds
        while self.store.writing and time.monotonic() < deadline:
            time.sleep(0.01)
        targets = self.live_ids(include_self=False)
        if not targets:
            log.info("event=handoff_skipped agent=%s reason=no_live_peers", self.agent_id)
            return 0
        plan: dict[str, list[str]] = {}
        for block in self.store.keys():
            for agent in rank(block.key, targets)[:self.replicas]:
                plan.setdefault(agent, []).append(block.key)
        moved = 0
        started = time.monotonic()
        for agent, keys in plan.items():
            address = self._address_of(agent)
            for i in range(0, len(keys), HANDOFF_BATCH):
                try:
                    moved += self._push(address, keys[i:i + HANDOFF_BATCH])
                except Exception as exc:  # a peer failing must not stop the others
                    log.warning("event=handoff_failed agent=%s peer=%s keys=%d reason=%s", self.agent_id, address,
                                len(keys[i:i + HANDOFF_BATCH]), exc)
                    break
        log.info("event=handoff_done agent=%s blocks=%d peers=%d seconds=%.2f", self.agent_id, moved, len(plan),
                 time.monotonic() - started)
        return moved

    def _push(self, address: str, keys: list[str]) -> int:
        with self.pool_conns.borrow(address) as conn:
            there = conn.exists(keys)
            missing = [k for k, info in zip(keys, there, strict=True) if info.status != p.Status.OK]
            if not missing:
                return 0
            blocks = self.store.acquire(missing)
            try:
                held = [b for b in blocks if b is not None]
                views = [self._read_view(b) for b in held]
                infos = conn.put([b.key for b in held], views, [b.checksum for b in held], flags=p.FLAG_REPLICA)
            finally:
                self.store.release(blocks)
            return sum(1 for info in infos if info.status == p.Status.OK)

    def _read_view(self, block: Block) -> memoryview:
        if block.staged is not None:
            return block.staged
        if block.tier == "hbm":
            out = memoryview(bytearray(block.size))
            self.store.read_hbm_into(block, out)
            return out
        return self.store.view(block)

    # -- pull-through -----------------------------------------------------------------------------

    def _await_writes(self, keys: list[str], *, timeout_seconds: float = 2.0) -> None:
        """Wait for blocks that are arriving right now (a hand-off, a pull, a client) to be committed."""
        deadline = time.monotonic() + timeout_seconds
        while time.monotonic() < deadline and any(k in self.store.writing for k in keys):
            time.sleep(0.005)

    def _pull(self, keys: list[str]) -> None:
        """At a key's home: fetch blocks missing here from the other agents (a joiner taking over its share)."""
        missing = [k for k, b in zip(keys, self.store.exists(keys), strict=True)
                   if b is None and self._pointer(k) is None]
        # A block being written here (say, handed over by a leaving agent) is not missing.
        self._await_writes(missing)
        missing = [k for k, b in zip(missing, self.store.exists(missing), strict=True) if b is None]
        # Live peers in rank order, then the others we know of: a leaving agent still holds the
        # blocks it is handing over (and is no longer ranked), and a joiner's first reads may come
        # before its heartbeats have marked everyone live.
        live = self.live_ids(include_self=False)
        with self._peers_lock:
            unconfirmed = [x.agent_id or x.address for x in self._peers.values()
                           if (x.agent_id or x.address) not in live]
        if not missing or not (live or unconfirmed):
            return
        orders = {key: rank(key, live) + rank(key, unconfirmed) for key in missing}
        remaining = set(missing)
        for position in range(len(live) + len(unconfirmed)):
            # Round n asks each remaining key's n-th agent; one request per agent per round.
            by_peer: dict[str, list[str]] = {}
            for key in remaining:
                by_peer.setdefault(orders[key][position], []).append(key)
            for agent, group in by_peer.items():
                try:
                    self._pull_from(self._address_of(agent), group, remaining)
                except Exception as exc:  # a peer failing must not stop the others
                    log.info("event=pull_failed agent=%s peer=%s reason=%s", self.agent_id, agent, exc)
            if not remaining:
                return
        self._await_writes(list(remaining))  # lost a race with a concurrent write of the same key

    def _pull_from(self, address: str, keys: list[str], remaining: set[str]) -> None:
        with self.pool_conns.borrow(address, timeout_seconds=10.0) as conn:
            infos = conn.exists(keys)
            wanted: list[tuple[str, Reservation]] = []
            for key, info in zip(keys, infos, strict=True):
                if info.status != p.Status.OK:
                    continue
                res = self.store.reserve(key, info.size, info.checksum)
                if isinstance(res, Reservation):
                    wanted.append((key, res))
            if not wanted:
                return
            ok: list[Reservation] = []
            try:
                results = conn.get_into([k for k, _ in wanted], [self.store.target(r) for _, r in wanted])
                for (key, res), info in zip(wanted, results, strict=True):
                    if info.status == p.Status.OK and info.size == res.size and (
                            crc32c(self.store.target(res)) == res.checksum):
                        ok.append(res)
                        remaining.discard(key)
            finally:
                self.store.commit(ok)
                self.store.commit([r for _, r in wanted if r not in ok], ok=False)

    # -- connections ------------------------------------------------------------------------------

    def _accept_loop(self) -> None:
        while not self._closed.is_set():
            try:
                conn, peer = self.sock.accept()
            except OSError:
                if self._closed.is_set():
                    return
                continue
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            t = threading.Thread(target=self._serve, args=(conn, f"{peer[0]}:{peer[1]}"), daemon=True,
                                 name="store-conn")
            t.start()

    def _serve(self, conn: socket.socket, peer: str) -> None:
        with self._conns_lock:
            self._conns.add(conn)
        try:
            conn.settimeout(30.0)  # a client that stalls inside the handshake is dropped
            channel = _HelloChannel(conn, self._error)
            try:
                server_accept(channel, token=self.token)
            except AuthenticationFailed:
                self.store.metrics.rejected.labels(reason="auth").inc()
                log.warning("event=connection_refused agent=%s peer=%s reason=wrong_token", self.agent_id, peer)
                return
            reply = p.HelloReply(self.agent_id, self.pool, self.probe.name, self.nonce, self.lease_seconds,
                                 self.replicas).encode()
            send_all(conn, p.frame(p.Op.REPLY, reply, request_id=channel.request_id))
            conn.settimeout(None)
            while not self._closed.is_set():
                try:
                    header, meta = p.read_frame(conn)
                except ConnectionError:
                    return
                started = time.perf_counter()
                self._dispatch(conn, header, meta)
                self.store.metrics.latency.labels(op=header.op.name.lower()).observe(time.perf_counter() - started)
        except p.ProtocolError as exc:
            self.store.metrics.rejected.labels(reason="protocol").inc()
            log.warning("event=connection_closed agent=%s peer=%s reason=%r", self.agent_id, peer, str(exc))
        except (ConnectionError, TimeoutError, OSError) as exc:
            log.debug("event=connection_lost agent=%s peer=%s reason=%s", self.agent_id, peer, exc)
        finally:
            with self._conns_lock:
                self._conns.discard(conn)
            conn.close()

    def _error(self, conn: socket.socket, rid: int, text: str) -> None:
        with contextlib.suppress(OSError):
            send_all(conn, p.frame(p.Op.ERROR, p.TextReply(text).encode(), request_id=rid))

    def _reply(self, conn: socket.socket, rid: int, meta: bytes, data: list[memoryview] | None = None) -> None:
        total = sum(len(d) for d in data or [])
        send_all(conn, [*p.frame(p.Op.REPLY, meta, request_id=rid, data_len=total), *(data or [])])

    def _dispatch(self, conn: socket.socket, header: p.Header, meta: bytearray) -> None:
        op, rid = header.op, header.request_id
        if op in (p.Op.REPLY, p.Op.ERROR, p.Op.HELLO):
            raise p.ProtocolError(f"unexpected {op.name} frame from a client")
        request = p.decode_request(op, meta)
        if op != p.Op.PUT and header.data_len:
            raise p.ProtocolError(f"{op.name} carries no data section, got {header.data_len} bytes")
        if op == p.Op.PUT:
            assert isinstance(request, p.PutRequest)
            self._put(conn, header, request)
        elif op in (p.Op.GET, p.Op.LOCATE):
            assert isinstance(request, p.KeysRequest)
            if header.flags & p.FLAG_PULL:
                self._pull(request.keys)
            if op == p.Op.GET:
                self._get(conn, rid, request)
            else:
                self._locate(conn, rid, request)
        elif op == p.Op.EXISTS:
            assert isinstance(request, p.KeysRequest)
            infos = [p.BlockInfo(p.Status.OK, b.size, b.checksum) if b else p.BlockInfo(p.Status.MISS)
                     for b in self.store.exists(request.keys)]
            self._reply(conn, rid, p.BlocksReply(infos).encode())
        elif op == p.Op.REMOVE:
            assert isinstance(request, p.KeysRequest)
            statuses = self.store.remove(request.keys)
            with self._pointers_lock:
                for key in request.keys:
                    self.pointers.pop(key, None)
            self._reply(conn, rid, p.BlocksReply([p.BlockInfo(s) for s in statuses]).encode())
        elif op == p.Op.REPORT:
            assert isinstance(request, p.KeysRequest)
            infos = [p.BlockInfo(p.Status.CORRUPT if self.store.drop_corrupt(k) else p.Status.OK)
                     for k in request.keys]
            self._reply(conn, rid, p.BlocksReply(infos).encode())
        elif op == p.Op.RELEASE:
            assert isinstance(request, p.LeaseRequest)
            self.store.end_lease(request.lease_id)
        elif op == p.Op.ALLOC:
            assert isinstance(request, p.AllocRequest)
            self._alloc(conn, rid, request)
        elif op == p.Op.COMMIT:
            assert isinstance(request, p.LeaseRequest)
            parked = self.store.unpark(request.lease_id) or []
            done = [r for r in parked if r is not None]
            self.store.commit(done, ok=not header.flags & p.FLAG_ABORT)
            if header.flags & p.FLAG_RECORD and not header.flags & p.FLAG_ABORT and done:
                self._records.put([r.key for r in done])
            self._reply(conn, rid, p.BlocksReply([p.BlockInfo(p.Status.OK if r else p.Status.MISS)
                                                  for r in parked]).encode())
        elif op == p.Op.RECORD:
            assert isinstance(request, p.RecordRequest)
            self._note(request.holder, request.keys)
            self._reply(conn, rid, p.BlocksReply([p.BlockInfo(p.Status.OK) for _ in request.keys]).encode())
        elif op == p.Op.MEMBERS:
            self._reply(conn, rid, p.MembersReply(self.members()).encode())
        elif op == p.Op.PING:
            assert isinstance(request, p.MembersReply)
            for member in request.members[:1]:
                self._heard(member)
            self._reply(conn, rid, p.MembersReply(self.members()).encode())
        elif op == p.Op.STATS:
            counts = {**self.store.stats(), "rss_bytes": _rss_bytes(), "rss_peak_bytes": _peak_rss_bytes(), "peers_live": len(self.live_ids()) - 1,
                      "pointers": len(self.pointers)}
            text = "\n".join(f"{k}={v}" for k, v in counts.items())
            self._reply(conn, rid, p.TextReply(text).encode())

    def _put(self, conn: socket.socket, header: p.Header, req: p.PutRequest) -> None:
        if header.data_len != sum(req.sizes):
            raise p.ProtocolError(f"PUT data section is {header.data_len} bytes, sizes add up to {sum(req.sizes)}")
        tier = "hbm" if req.tier == 1 else "dram"
        with self._admission:
            refused = self.leaving and not header.flags & p.FLAG_REPLICA
            slots = [] if refused else [self.store.reserve(k, s, c, tier=tier, pin_seconds=req.pin_seconds)
                                        for k, s, c in zip(req.keys, req.sizes, req.checksums, strict=True)]
        if refused:
            discard(conn, header.data_len)
            self._reply(conn, header.request_id,
                        p.BlocksReply([p.BlockInfo(p.Status.LEAVING) for _ in req.keys]).encode())
            return
        reserved = [s for s in slots if isinstance(s, Reservation)]
        try:
            for slot, size in zip(slots, req.sizes, strict=True):
                if not isinstance(slot, Reservation):
                    discard(conn, size)
                elif slot.tier == "hbm":
                    staging = memoryview(bytearray(size))
                    recv_exact_into(conn, staging)
                    self.store.write_hbm(slot, staging)
                else:
                    recv_exact_into(conn, self.store.target(slot))
        except BaseException:
            self.store.commit(reserved, ok=False)
            raise
        self.store.commit(reserved)
        if header.flags & p.FLAG_RECORD and reserved:
            self._records.put([r.key for r in reserved])
        infos = [p.BlockInfo(p.Status.OK, s.size, s.checksum) if isinstance(s, Reservation) else p.BlockInfo(s)
                 for s in slots]
        self._reply(conn, header.request_id, p.BlocksReply(infos).encode())

    def _get(self, conn: socket.socket, rid: int, req: p.KeysRequest) -> None:
        blocks = self.store.acquire(req.keys)
        try:
            infos: list[p.BlockInfo] = []
            data: list[memoryview] = []
            for i, block in enumerate(blocks):
                if block is None:
                    holder = self._pointer(req.keys[i])
                    infos.append(p.BlockInfo(p.Status.REDIRECT, where=holder) if holder else p.BlockInfo(p.Status.MISS))
                elif req.capacities and block.size > req.capacities[i]:
                    infos.append(p.BlockInfo(p.Status.TOO_SMALL, block.size, block.checksum))
                else:
                    infos.append(p.BlockInfo(p.Status.OK, block.size, block.checksum))
                    data.append(self._read_view(block))
            self._reply(conn, rid, p.BlocksReply(infos).encode(), data)
        finally:
            self.store.release(blocks)

    def _locate(self, conn: socket.socket, rid: int, req: p.KeysRequest) -> None:
        blocks = self.store.acquire(req.keys, count=False)
        infos: list[p.BlockInfo] = []
        for key, block in zip(req.keys, blocks, strict=True):
            if block is None or block.tier == "dram":
                self.store.record(block)  # others are counted by the GET that fetches them
            if block is None:
                holder = self._pointer(key)
                infos.append(p.BlockInfo(p.Status.REDIRECT, where=holder) if holder else p.BlockInfo(p.Status.MISS))
            elif block.tier != "dram":
                # Not mappable from another process: the client falls back to GET for it.
                infos.append(p.BlockInfo(p.Status.OK, block.size, block.checksum, ""))
            else:
                infos.append(p.BlockInfo(p.Status.OK, block.size, block.checksum,
                                         self.store.dram.segment_name(block.segment), block.offset))
        lease_id = self.store.lease(blocks)
        self._reply(conn, rid, p.BlocksReply(infos, lease_id).encode())

    def _alloc(self, conn: socket.socket, rid: int, req: p.AllocRequest) -> None:
        with self._admission:
            refused = self.leaving
            slots = [] if refused else [self.store.reserve(k, s, c, pin_seconds=req.pin_seconds)
                                        for k, s, c in zip(req.keys, req.sizes, req.checksums, strict=True)]
        if refused:
            self._reply(conn, rid, p.BlocksReply([p.BlockInfo(p.Status.LEAVING) for _ in req.keys]).encode())
            return
        parked: list[Reservation | None] = [s if isinstance(s, Reservation) else None for s in slots]
        rid_parked = self.store.park(parked)
        infos = [p.BlockInfo(p.Status.OK, s.size, s.checksum, self.store.dram.segment_name(s.segment), s.offset)
                 if isinstance(s, Reservation) else p.BlockInfo(s) for s in slots]
        self._reply(conn, rid, p.BlocksReply(infos, rid_parked).encode())


class _HelloChannel:
    """The store protocol's side of ``pool.handshake.ServerChannel``: the first frame must be a HELLO."""

    def __init__(self, conn: socket.socket, error: Callable[[socket.socket, int, str], None]) -> None:
        self._conn = conn
        self._error = error
        self.request_id = 0

    def recv_hello(self) -> Hello:
        header, meta = p.read_frame(self._conn)
        if header.op != p.Op.HELLO:
            raise p.ProtocolError(f"first frame is {header.op.name}, expected HELLO")
        self.request_id = header.request_id
        hello = p.Hello.decode(meta)
        if header.data_len:  # a HELLO has no data section: refused like a wrong token
            self.send_refusal("wrong pool token")
            raise AuthenticationFailed("HELLO frame with a data section")
        return Hello(hello.token, hello.client)

    def send_refusal(self, reason: str) -> None:
        self._error(self._conn, self.request_id, f"authentication failed: {reason}")


def _rss_bytes() -> int:
    """Resident set size of this process (includes the shared-memory pages it has touched)."""
    try:
        with open(f"/proc/{os.getpid()}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


def _peak_rss_bytes() -> int:
    """High-water mark of the resident set (VmHWM)."""
    try:
        with open(f"/proc/{os.getpid()}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0
