"""The store's wire protocol: one definition of every frame, used by the agent and the client alike.

A frame is a fixed 24-byte header, a metadata section of ``meta_len`` bytes
and a data section of ``data_len`` raw bytes::

    magic "DBKV" | version u8 | op u8 | flags u16 | request_id u32 | meta_len u32 | data_len u64

All integers are little-endian. The metadata section is a flat binary record
whose layout depends on ``op`` (see the ``encode_*``/``decode_*`` pairs); the
data section carries block bytes back to back in the order of the keys, so a
receiver can ``recv_into`` each caller buffer in turn without an intermediate
copy. See docs/protocol.md for the full table.

PARSING IS THE TRUST BOUNDARY: every length, count and enum read from the wire
is checked against the limits below before anything is allocated, and any
violation raises ``ProtocolError``; the server answers it by closing that one
connection.
"""

from __future__ import annotations

import enum
import socket
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from daybreak.errors import DaybreakError
from daybreak.pool.credentials import NAMESPACE_PATTERN
from daybreak.pool.sockets import recv_exact

MAGIC = b"DBKV"
VERSION = 3  # 2: challenge-response HELLO; 3: XLOCATE/XALLOC replies carry capabilities (docs/protocol.md)
HEADER = struct.Struct("<4sBBHIIQ")
HEADER_SIZE = HEADER.size  # 24

# Limits that bound what one frame can make a receiver allocate.
MAX_META_BYTES = 4 << 20
MAX_DATA_BYTES = 4 << 30
MAX_KEYS = 4096
MAX_KEY_BYTES = 512
MAX_BLOCK_BYTES = 1 << 30
MAX_TOKEN_BYTES = 256
MAX_TEXT_BYTES = 4096
# Before authentication a frame may carry at most this much metadata and no data at all.
MAX_PREAUTH_META_BYTES = 1024
MAX_ADDRESS_BYTES = 256  # an agent address (RECORD holder, member address)
MAX_CAPABILITY_BYTES = 256  # one one-sided access capability (pool/capability.py: 68 bytes today)


Raw = bytes | bytearray | memoryview


class ProtocolError(DaybreakError):
    """A frame that breaks the protocol; the connection that sent it is closed."""


class Op(enum.IntEnum):
    """Frame kinds. Every request but RELEASE is answered by one ``REPLY`` or ``ERROR`` frame."""

    HELLO = 1        # the two client messages of the handshake: claim + nonce, then proof
    PUT = 2          # keys, sizes, checksums; data section holds the blocks
    GET = 3          # keys and caller capacities; reply data holds the hits
    EXISTS = 4       # keys; reply holds sizes
    REMOVE = 5       # keys; reply holds per-key status
    LOCATE = 6       # same-node get: reply holds (segment, offset) and a lease per key
    RELEASE = 7      # one-way: drop leases taken by LOCATE (no reply)
    ALLOC = 8        # same-node put: reserve space, reply holds (segment, offset) per key
    COMMIT = 9       # same-node put: publish (or abandon) what ALLOC reserved
    MEMBERS = 10     # the pool's live agents as this agent sees them
    PING = 11        # agent-to-agent liveness
    STATS = 12       # counters as a small text record (tests, bench)
    REPORT = 13      # a client found a checksum mismatch: verify and drop the block
    RECORD = 14      # agent-to-agent: "I hold these keys" (local-first writes, recorded at their home)
    # The transfer engine's control ops (docs/architecture.md, "Control vs data"): bytes move by the
    # engine (shm, link, rdma) into the agent's registered segments, the store protocol says where.
    SEGMENTS = 15    # the agent's registered segments: (tier, index, descriptor JSON) each
    XLOCATE = 16     # engine get: reply holds (segment id, offset) per key and a lease to RELEASE
    XALLOC = 17      # engine put: reserve (any tier), reply holds (segment id, offset); COMMIT publishes
    FLUSH_NAMESPACE = 18  # delete every block of one kvNamespace from this agent; reply: what was freed
    REPLY = 64
    ERROR = 65


class Status(enum.IntEnum):
    """Per-key outcome in replies."""

    OK = 0
    MISS = 1
    FULL = 2          # no space even after eviction (everything leased or in flight)
    TOO_SMALL = 3     # caller buffer smaller than the stored block
    LEAVING = 4       # this agent is handing its blocks off; write elsewhere
    CORRUPT = 5       # checksum mismatch found; the block was removed
    TOO_LARGE = 6     # block larger than the agent accepts
    BUSY = 7          # the key is being written right now
    REDIRECT = 8      # not here, but recorded: ``where`` names the agent that holds it


# Flags (header ``flags``).
FLAG_REPLICA = 1 << 0   # PUT from another agent (handoff, pull-through): do not forward
FLAG_PULL = 1 << 1      # GET/LOCATE at the key's home: on a miss, fetch from the other agents
FLAG_ABORT = 1 << 2     # COMMIT: abandon the reservation instead of publishing it
FLAG_RECORD = 1 << 3    # PUT/COMMIT away from the key's home: record the holder there (local-first writes)
FLAG_AGENT_CRC = 1 << 4  # XALLOC: the writer cannot checksum its bytes (device memory); the agent does at COMMIT


@dataclass(frozen=True)
class Header:
    op: Op
    flags: int
    request_id: int
    meta_len: int
    data_len: int


def pack_header(*, op: Op, flags: int = 0, request_id: int = 0, meta_len: int = 0, data_len: int = 0) -> bytes:
    return HEADER.pack(MAGIC, VERSION, int(op), flags, request_id & 0xFFFFFFFF, meta_len, data_len)


def unpack_header(raw: bytes | bytearray | memoryview) -> Header:
    """Parse and bound-check a header; raises ProtocolError on anything unexpected."""
    if len(raw) != HEADER_SIZE:
        raise ProtocolError(f"header is {len(raw)} bytes, expected {HEADER_SIZE}")
    magic, version, op, flags, request_id, meta_len, data_len = HEADER.unpack(raw)
    if magic != MAGIC:
        raise ProtocolError(f"bad magic {bytes(magic)!r}")
    if version != VERSION:
        raise ProtocolError(f"unsupported protocol version {version} (this side speaks {VERSION})")
    try:
        kind = Op(op)
    except ValueError:
        raise ProtocolError(f"unknown op {op}") from None
    if meta_len > MAX_META_BYTES:
        raise ProtocolError(f"meta_len {meta_len} exceeds {MAX_META_BYTES}")
    if data_len > MAX_DATA_BYTES:
        raise ProtocolError(f"data_len {data_len} exceeds {MAX_DATA_BYTES}")
    return Header(kind, flags, request_id, meta_len, data_len)


# -- metadata codec ------------------------------------------------------------------------


_U8, _U16, _U32, _U64 = (struct.Struct(f) for f in ("<B", "<H", "<I", "<Q"))


class Writer:
    """Appends little-endian fields to a bytearray."""

    def __init__(self) -> None:
        self.buf = bytearray()

    def u8(self, v: int) -> Writer:
        self.buf += _U8.pack(v)
        return self

    def u16(self, v: int) -> Writer:
        self.buf += _U16.pack(v)
        return self

    def u32(self, v: int) -> Writer:
        self.buf += _U32.pack(v)
        return self

    def u64(self, v: int) -> Writer:
        self.buf += _U64.pack(v)
        return self

    def blob(self, v: bytes, *, limit: int) -> Writer:
        if len(v) > limit:
            raise ValueError(f"field of {len(v)} bytes exceeds {limit}")
        self.u16(len(v)) if limit <= 0xFFFF else self.u32(len(v))
        self.buf += v
        return self

    def text(self, v: str, *, limit: int = MAX_TEXT_BYTES) -> Writer:
        return self.blob(v.encode(), limit=limit)

    def u64s(self, values: Sequence[int]) -> Writer:
        self.buf += struct.pack(f"<{len(values)}Q", *values)
        return self

    def u32s(self, values: Sequence[int]) -> Writer:
        self.buf += struct.pack(f"<{len(values)}I", *values)
        return self


class Reader:
    """Reads fields back, raising ProtocolError on truncation or out-of-range values."""

    def __init__(self, data: Raw) -> None:
        self.data = bytes(data)
        self.pos = 0

    def _take(self, n: int) -> bytes:
        end = self.pos + n
        if n < 0 or end > len(self.data):
            raise ProtocolError(f"metadata truncated at byte {self.pos} (wanted {n} more)")
        chunk = self.data[self.pos:end]
        self.pos = end
        return chunk

    def _fixed(self, fmt: struct.Struct) -> int:
        end = self.pos + fmt.size
        if end > len(self.data):
            raise ProtocolError(f"metadata truncated at byte {self.pos} (wanted {fmt.size} more)")
        (value,) = fmt.unpack_from(self.data, self.pos)
        self.pos = end
        return int(value)

    def u8(self) -> int:
        return self._fixed(_U8)

    def u16(self) -> int:
        return self._fixed(_U16)

    def u32(self) -> int:
        return self._fixed(_U32)

    def u64(self) -> int:
        return self._fixed(_U64)

    def blob(self, *, limit: int) -> bytes:
        n = self.u16() if limit <= 0xFFFF else self.u32()
        if n > limit:
            raise ProtocolError(f"field of {n} bytes exceeds {limit}")
        return self._take(n)

    def text(self, *, limit: int = MAX_TEXT_BYTES) -> str:
        raw = self.blob(limit=limit)
        try:
            return raw.decode()
        except UnicodeDecodeError:
            raise ProtocolError("text field is not UTF-8") from None

    def count(self, *, limit: int = MAX_KEYS) -> int:
        n = self.u32()
        if n > limit:
            raise ProtocolError(f"count {n} exceeds {limit}")
        return n

    def u64s(self, n: int) -> list[int]:
        return list(struct.unpack(f"<{n}Q", self._take(8 * n)))

    def u32s(self, n: int) -> list[int]:
        return list(struct.unpack(f"<{n}I", self._take(4 * n)))

    def end(self) -> None:
        if self.pos != len(self.data):
            raise ProtocolError(f"{len(self.data) - self.pos} trailing metadata bytes")


def _keys(w: Writer, keys: Sequence[str]) -> None:
    if len(keys) > MAX_KEYS:
        raise ValueError(f"batch of {len(keys)} keys exceeds {MAX_KEYS}")
    w.u32(len(keys))
    for k in keys:
        w.text(k, limit=MAX_KEY_BYTES)


def _read_keys(r: Reader) -> list[str]:
    n = r.count()
    keys = [r.text(limit=MAX_KEY_BYTES) for _ in range(n)]
    if any(not k for k in keys):
        raise ProtocolError("empty key")
    return keys


def _statuses(r: Reader, n: int) -> list[Status]:
    out = []
    for _ in range(n):
        v = r.u8()
        try:
            out.append(Status(v))
        except ValueError:
            raise ProtocolError(f"unknown status {v}") from None
    return out


# -- messages -------------------------------------------------------------------------------


@dataclass
class Hello:
    """First HELLO: who the client is, the scope it claims (``admin``, ``agent``, ``ns:<name>``), its nonce."""

    client: str
    scope: str
    nonce: bytes

    def encode(self) -> bytes:
        return bytes(Writer().text(self.client, limit=MAX_ADDRESS_BYTES).text(self.scope, limit=MAX_ADDRESS_BYTES)
                     .blob(self.nonce, limit=64).buf)

    @classmethod
    def decode(cls, raw: Raw) -> Hello:
        r = Reader(raw)
        msg = cls(r.text(limit=MAX_ADDRESS_BYTES), r.text(limit=MAX_ADDRESS_BYTES), r.blob(limit=64))
        r.end()
        return msg


@dataclass
class HelloChallenge:
    """The server's REPLY to the first HELLO: its nonce and its proof (see ``pool/handshake.py``)."""

    nonce: bytes
    proof: bytes

    def encode(self) -> bytes:
        return bytes(Writer().blob(self.nonce, limit=64).blob(self.proof, limit=64).buf)

    @classmethod
    def decode(cls, raw: Raw) -> HelloChallenge:
        r = Reader(raw)
        msg = cls(r.blob(limit=64), r.blob(limit=64))
        r.end()
        return msg


@dataclass
class HelloProof:
    """Second HELLO: the client's proof; answered by ``HelloReply`` or an ERROR frame."""

    proof: bytes

    def encode(self) -> bytes:
        return bytes(Writer().blob(self.proof, limit=64).buf)

    @classmethod
    def decode(cls, raw: Raw) -> HelloProof:
        r = Reader(raw)
        msg = cls(r.blob(limit=64))
        r.end()
        return msg


@dataclass
class HelloReply:
    agent_id: str
    pool: str
    shm_probe: str        # a segment name holding ``shm_nonce``: a client that can map it shares /dev/shm
    shm_nonce: bytes
    lease_seconds: int
    replicas: int = 1     # copies the pool keeps of each block

    def encode(self) -> bytes:
        w = Writer().text(self.agent_id).text(self.pool).text(self.shm_probe).blob(self.shm_nonce, limit=64)
        return bytes(w.u32(self.lease_seconds).u8(self.replicas).buf)

    @classmethod
    def decode(cls, raw: Raw) -> HelloReply:
        r = Reader(raw)
        msg = cls(r.text(), r.text(), r.text(), r.blob(limit=64), r.u32(), r.u8())
        r.end()
        return msg


@dataclass
class PutRequest:
    """Blocks to store; the frame's data section holds ``sizes`` bytes per key in order."""

    keys: list[str]
    sizes: list[int]
    checksums: list[int]
    pin_seconds: int = 0
    tier: int = 0  # 0 = agent's default (DRAM), 1 = HBM when enabled

    def encode(self) -> bytes:
        w = Writer()
        _keys(w, self.keys)
        w.u64s(self.sizes).u32s(self.checksums).u32(self.pin_seconds).u8(self.tier)
        return bytes(w.buf)

    @classmethod
    def decode(cls, raw: Raw) -> PutRequest:
        r = Reader(raw)
        keys = _read_keys(r)
        sizes = r.u64s(len(keys))
        checksums = r.u32s(len(keys))
        msg = cls(keys, sizes, checksums, r.u32(), r.u8())
        r.end()
        if any(s > MAX_BLOCK_BYTES for s in sizes):
            raise ProtocolError(f"block size over {MAX_BLOCK_BYTES}")
        if msg.tier > 1:
            raise ProtocolError(f"unknown tier {msg.tier}")
        return msg


@dataclass
class KeysRequest:
    """GET, EXISTS, REMOVE, LOCATE, REPORT: keys plus, for GET, the caller's buffer capacities."""

    keys: list[str]
    capacities: list[int] = field(default_factory=list)

    def encode(self) -> bytes:
        w = Writer()
        _keys(w, self.keys)
        w.u32(len(self.capacities)).u64s(self.capacities)
        return bytes(w.buf)

    @classmethod
    def decode(cls, raw: Raw) -> KeysRequest:
        r = Reader(raw)
        keys = _read_keys(r)
        n = r.count()
        if n not in (0, len(keys)):
            raise ProtocolError(f"{n} capacities for {len(keys)} keys")
        msg = cls(keys, r.u64s(n))
        r.end()
        return msg


@dataclass
class BlockInfo:
    """Per-key reply entry. ``where`` is a segment name for LOCATE/ALLOC, a redirect address otherwise."""

    status: Status
    size: int = 0
    checksum: int = 0
    where: str = ""
    offset: int = 0


_ENTRY = struct.Struct("<BQIH")  # status, size, crc32c, length of ``where``


@dataclass
class BlocksReply:
    """Reply to PUT/GET/EXISTS/REMOVE/LOCATE/ALLOC/REPORT; for GET the data section holds the OK blocks.

    ``capabilities`` (XLOCATE, XALLOC): one per block, opaque, empty where the block has none
    (``pool/capability.py``); every other reply carries none.
    """

    blocks: list[BlockInfo]
    lease_id: int = 0
    capabilities: list[bytes] = field(default_factory=list)

    def encode(self) -> bytes:
        if self.capabilities and len(self.capabilities) != len(self.blocks):
            raise ValueError(f"{len(self.capabilities)} capabilities for {len(self.blocks)} blocks")
        w = Writer().u32(len(self.blocks)).u64(self.lease_id)
        for b in self.blocks:
            w.u8(int(b.status)).u64(b.size).u32(b.checksum).text(b.where, limit=MAX_KEY_BYTES).u64(b.offset)
        w.u32(len(self.capabilities))
        for cap in self.capabilities:
            w.blob(cap, limit=MAX_CAPABILITY_BYTES)
        return bytes(w.buf)

    def capability(self, index: int) -> bytes:
        """The capability of block ``index``; b'' where the reply carries none."""
        return self.capabilities[index] if self.capabilities else b""

    @classmethod
    def decode(cls, raw: Raw) -> BlocksReply:
        r = Reader(raw)
        n = r.count()
        lease_id = r.u64()
        blocks = []
        data = r.data
        for _ in range(n):
            if r.pos + _ENTRY.size + 8 > len(data):
                raise ProtocolError(f"metadata truncated at byte {r.pos}")
            status, size, checksum, where_len = _ENTRY.unpack_from(data, r.pos)
            r.pos += _ENTRY.size
            if where_len > MAX_KEY_BYTES:
                raise ProtocolError(f"field of {where_len} bytes exceeds {MAX_KEY_BYTES}")
            try:
                where = r._take(where_len).decode()
                kind = Status(status)
            except UnicodeDecodeError:
                raise ProtocolError("text field is not UTF-8") from None
            except ValueError:
                raise ProtocolError(f"unknown status {status}") from None
            if size > MAX_BLOCK_BYTES:
                raise ProtocolError(f"block size over {MAX_BLOCK_BYTES}")
            blocks.append(BlockInfo(kind, size, checksum, where, r.u64()))
        caps = r.count()
        if caps not in (0, n):
            raise ProtocolError(f"{caps} capabilities for {n} blocks")
        capabilities = [r.blob(limit=MAX_CAPABILITY_BYTES) for _ in range(caps)]
        r.end()
        return cls(blocks, lease_id, capabilities)


@dataclass
class AllocRequest:
    keys: list[str]
    sizes: list[int]
    checksums: list[int]
    pin_seconds: int = 0

    def encode(self) -> bytes:
        return PutRequest(self.keys, self.sizes, self.checksums, self.pin_seconds).encode()

    @classmethod
    def decode(cls, raw: Raw) -> AllocRequest:
        p = PutRequest.decode(raw)
        return cls(p.keys, p.sizes, p.checksums, p.pin_seconds)


@dataclass
class LeaseRequest:
    """RELEASE and COMMIT: the lease (or reservation) id returned by LOCATE or ALLOC."""

    lease_id: int

    def encode(self) -> bytes:
        return bytes(Writer().u64(self.lease_id).buf)

    @classmethod
    def decode(cls, raw: Raw) -> LeaseRequest:
        r = Reader(raw)
        msg = cls(r.u64())
        r.end()
        return msg


@dataclass
class Member:
    agent_id: str
    address: str
    state: int = 0  # 0 = serving, 1 = leaving


@dataclass
class MembersReply:
    members: list[Member]

    def encode(self) -> bytes:
        w = Writer().u32(len(self.members))
        for m in self.members:
            w.text(m.agent_id, limit=MAX_ADDRESS_BYTES).text(m.address, limit=MAX_ADDRESS_BYTES).u8(m.state)
        return bytes(w.buf)

    @classmethod
    def decode(cls, raw: Raw) -> MembersReply:
        r = Reader(raw)
        n = r.count(limit=1024)
        msg = cls([Member(r.text(limit=MAX_ADDRESS_BYTES), r.text(limit=MAX_ADDRESS_BYTES), r.u8())
                   for _ in range(n)])
        r.end()
        return msg


@dataclass
class TextReply:
    """ERROR and STATS bodies: UTF-8 text (``key=value`` lines for STATS)."""

    text: str

    def encode(self) -> bytes:
        return bytes(Writer().blob(self.text.encode(), limit=MAX_META_BYTES - 8).buf)

    @classmethod
    def decode(cls, raw: Raw) -> TextReply:
        r = Reader(raw)
        try:
            msg = cls(r.blob(limit=MAX_META_BYTES - 8).decode())
        except UnicodeDecodeError:
            raise ProtocolError("text is not UTF-8") from None
        r.end()
        return msg


@dataclass
class RecordRequest:
    """RECORD: ``holder`` (an agent address) holds ``keys``."""

    holder: str
    keys: list[str]

    def encode(self) -> bytes:
        w = Writer().text(self.holder, limit=MAX_ADDRESS_BYTES)
        _keys(w, self.keys)
        return bytes(w.buf)

    @classmethod
    def decode(cls, raw: Raw) -> RecordRequest:
        r = Reader(raw)
        msg = cls(r.text(limit=MAX_ADDRESS_BYTES), _read_keys(r))
        r.end()
        return msg


@dataclass
class SegmentEntry:
    """One registered segment of an agent: the tier it backs, its index there, its engine descriptor (JSON)."""

    tier: int  # 0 = DRAM, 1 = HBM
    index: int
    descriptor: str


@dataclass
class SegmentsReply:
    """Reply to SEGMENTS: what a client opens with its transfer engine to reach the agent's tiers."""

    segments: list[SegmentEntry]

    def encode(self) -> bytes:
        w = Writer().u32(len(self.segments))
        for e in self.segments:
            w.u8(e.tier).u32(e.index).blob(e.descriptor.encode(), limit=MAX_TEXT_BYTES * 4)
        return bytes(w.buf)

    @classmethod
    def decode(cls, raw: Raw) -> SegmentsReply:
        r = Reader(raw)
        n = r.count(limit=1024)
        out = []
        for _ in range(n):
            tier, index = r.u8(), r.u32()
            try:
                text = r.blob(limit=MAX_TEXT_BYTES * 4).decode()
            except UnicodeDecodeError:
                raise ProtocolError("segment descriptor is not UTF-8") from None
            if tier > 1:
                raise ProtocolError(f"unknown tier {tier}")
            out.append(SegmentEntry(tier, index, text))
        r.end()
        return cls(out)


@dataclass
class NamespaceRequest:
    """FLUSH_NAMESPACE: the kvNamespace whose blocks (keys starting ``<namespace>/``) are deleted."""

    namespace: str

    def encode(self) -> bytes:
        return bytes(Writer().text(self.namespace, limit=MAX_KEY_BYTES).buf)

    @classmethod
    def decode(cls, raw: Raw) -> NamespaceRequest:
        r = Reader(raw)
        msg = cls(r.text(limit=MAX_KEY_BYTES))
        r.end()
        if not NAMESPACE_PATTERN.fullmatch(msg.namespace):
            raise ProtocolError(f"namespace {msg.namespace!r} does not match {NAMESPACE_PATTERN.pattern}")
        return msg


@dataclass
class FlushReply:
    """FLUSH_NAMESPACE: what one agent deleted; ``busy`` blocks were being read and are left to age out."""

    blocks: int
    bytes_freed: int
    busy: int = 0
    pointers: int = 0

    def encode(self) -> bytes:
        return bytes(Writer().u64(self.blocks).u64(self.bytes_freed).u64(self.busy).u64(self.pointers).buf)

    @classmethod
    def decode(cls, raw: Raw) -> FlushReply:
        r = Reader(raw)
        msg = cls(r.u64(), r.u64(), r.u64(), r.u64())
        r.end()
        return msg


# Which metadata record each request op carries (used by the server's dispatcher and the fuzzer).
REQUEST_TYPES: dict[Op, Any] = {
    Op.HELLO: Hello,
    Op.PUT: PutRequest,
    Op.GET: KeysRequest,
    Op.EXISTS: KeysRequest,
    Op.REMOVE: KeysRequest,
    Op.LOCATE: KeysRequest,
    Op.REPORT: KeysRequest,
    Op.RELEASE: LeaseRequest,
    Op.ALLOC: AllocRequest,
    Op.COMMIT: LeaseRequest,
    Op.PING: MembersReply,
    Op.RECORD: RecordRequest,
    Op.XLOCATE: KeysRequest,
    Op.XALLOC: PutRequest,
    Op.FLUSH_NAMESPACE: NamespaceRequest,
}


def decode_request(op: Op, raw: Raw) -> object:
    """Decode a request's metadata; ops without metadata must send none."""
    kind = REQUEST_TYPES.get(op)
    if kind is None:
        if len(raw):
            raise ProtocolError(f"op {op.name} carries no metadata, got {len(raw)} bytes")
        return None
    return kind.decode(raw)


# -- framing on a socket ----------------------------------------------------------------------


def read_frame(sock: socket.socket) -> tuple[Header, bytearray]:
    """Read one header and its metadata; the data section is left on the socket for the caller."""
    raw = recv_exact(sock, HEADER_SIZE)
    header = unpack_header(raw)
    return header, recv_exact(sock, header.meta_len)


def frame(op: Op, meta: bytes, *, flags: int = 0, request_id: int = 0, data_len: int = 0) -> list[bytes]:
    return [pack_header(op=op, flags=flags, request_id=request_id, meta_len=len(meta), data_len=data_len), meta]
