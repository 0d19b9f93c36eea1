"""The tcp transport's wire format: one definition of a frame, used by client and server.

Every frame is a fixed 24-byte header, then ``count`` 24-byte extent entries,
then ``payload_len`` payload bytes (``count`` and ``payload_len`` are the
length prefix: a reader knows exactly how much follows before reading it)::

    header  = magic "DT" | version u8 | type u8 | flags u16 | count u16 | frame_id u64 | payload_len u32 | caps_len u32
    extent  = segment u32 | crc32c u32 | offset u64 | length u64
    caps    = count x (length u16 | capability bytes)       (READ/WRITE with FLAG_CAPS: caps_len bytes)

Version 2 gave the last header word a meaning: a READ or WRITE with ``FLAG_CAPS``
carries, after its extents, one capability per extent (``pool/capability.py``,
opaque here; length 0 for none), which a server that checks one-sided access
(a store agent's engine) verifies before it touches a byte.
A WRITE carries its data as payload, in extent order; the answer is ACK or ERROR.
A READ carries no payload; the answer is DATA (the same extents, with crcs when
asked for, then the bytes) or ERROR. ERROR and HELLO payloads are UTF-8/JSON.
ANY header that fails ``parse_header`` means the stream can no longer be trusted:
the reader closes that one connection and nothing else.
"""

from __future__ import annotations

import enum
import struct
from collections.abc import Sequence
from dataclasses import dataclass

from daybreak.errors import DaybreakError

MAGIC = b"DT"
VERSION = 2  # 2: capabilities after the extents (FLAG_CAPS, caps_len)
HEADER = struct.Struct("!2sBBHHQII")
EXTENT = struct.Struct("!IIQQ")
assert HEADER.size == 24 and EXTENT.size == 24

# At most this many extents per frame: sendmsg takes one iovec per extent plus
# the header, and Linux caps a call at IOV_MAX (1024).
MAX_EXTENTS = 1000
# Largest payload one frame may carry; the sender slices below it.
MAX_PAYLOAD = 1 << 30
MAX_MESSAGE = 1 << 16  # HELLO / ERROR / RDMA payload cap

MAX_CAPABILITY = 256  # bytes of one capability (68 today)

FLAG_CRC = 0x1
FLAG_CAPS = 0x2  # READ/WRITE: a capability table of caps_len bytes follows the extents


class FrameType(enum.IntEnum):
    HELLO = 1
    WRITE = 2
    READ = 3
    ACK = 4
    DATA = 5
    ERROR = 6
    RDMA_CONNECT = 7


class MalformedFrame(DaybreakError):
    """The byte stream does not hold a valid frame; the connection must be closed."""


@dataclass(slots=True, frozen=True)
class Header:
    type: FrameType
    flags: int
    count: int
    frame_id: int
    payload_len: int
    caps_len: int = 0


@dataclass(slots=True, frozen=True)
class Extent:
    segment: int
    offset: int
    length: int
    crc: int = 0


def pack_header(kind: FrameType, *, frame_id: int, count: int = 0, payload_len: int = 0, flags: int = 0,
                caps_len: int = 0) -> bytes:
    return HEADER.pack(MAGIC, VERSION, kind, flags, count, frame_id, payload_len, caps_len)


def parse_header(raw: bytes | bytearray | memoryview) -> Header:
    """Decode and validate a header; raises ``MalformedFrame`` saying which field is wrong."""
    magic, version, kind, flags, count, frame_id, payload_len, caps_len = HEADER.unpack(raw)
    if magic != MAGIC:
        raise MalformedFrame(f"bad magic {bytes(magic)!r}")
    if version != VERSION:
        raise MalformedFrame(f"unsupported protocol version {version} (this side speaks {VERSION})")
    try:
        frame_type = FrameType(kind)
    except ValueError:
        raise MalformedFrame(f"unknown frame type {kind}") from None
    if count > MAX_EXTENTS:
        raise MalformedFrame(f"extent count {count} over the limit {MAX_EXTENTS}")
    if frame_type in (FrameType.HELLO, FrameType.ERROR, FrameType.RDMA_CONNECT, FrameType.ACK):
        if count or payload_len > MAX_MESSAGE:
            raise MalformedFrame(f"{frame_type.name} frame with count={count} payload_len={payload_len}")
    elif frame_type is FrameType.READ and payload_len:
        raise MalformedFrame(f"READ frame with payload_len={payload_len}")
    if payload_len > MAX_PAYLOAD:
        raise MalformedFrame(f"payload_len {payload_len} over the limit {MAX_PAYLOAD}")
    if frame_type in (FrameType.READ, FrameType.WRITE) and flags & FLAG_CAPS:
        if not 2 * count <= caps_len <= count * (2 + MAX_CAPABILITY):
            raise MalformedFrame(f"caps_len {caps_len} cannot hold {count} capabilities")
    elif caps_len:
        raise MalformedFrame(f"caps_len {caps_len} on a {frame_type.name} frame without FLAG_CAPS")
    return Header(frame_type, flags, count, frame_id, payload_len, caps_len)


def pack_extents(extents: Sequence[Extent]) -> bytes:
    return b"".join(EXTENT.pack(e.segment, e.crc, e.offset, e.length) for e in extents)


def parse_extents(raw: bytes | bytearray | memoryview, count: int, *, payload_len: int | None = None) -> list[Extent]:
    """Decode ``count`` extents; with ``payload_len`` also check the lengths add up to it."""
    extents = [Extent(seg, off, length, crc) for seg, crc, off, length in EXTENT.iter_unpack(raw[: count * EXTENT.size])]
    if payload_len is not None and sum(e.length for e in extents) != payload_len:
        raise MalformedFrame(f"extent lengths add up to {sum(e.length for e in extents)}, payload_len is {payload_len}")
    return extents


def pack_capabilities(capabilities: Sequence[bytes]) -> bytes:
    """The capability table of a READ/WRITE with ``FLAG_CAPS``: one length-prefixed entry per extent."""
    out = bytearray()
    for cap in capabilities:
        if len(cap) > MAX_CAPABILITY:
            raise ValueError(f"capability of {len(cap)} bytes over the limit {MAX_CAPABILITY}")
        out += len(cap).to_bytes(2, "big") + cap
    return bytes(out)


def parse_capabilities(raw: bytes | bytearray | memoryview, count: int) -> list[bytes]:
    """Decode ``count`` entries that must fill ``raw`` exactly; ``MalformedFrame`` otherwise."""
    out: list[bytes] = []
    pos = 0
    for _ in range(count):
        if pos + 2 > len(raw):
            raise MalformedFrame(f"capability table truncated at entry {len(out)}")
        n = int.from_bytes(raw[pos:pos + 2], "big")
        if n > MAX_CAPABILITY or pos + 2 + n > len(raw):
            raise MalformedFrame(f"capability entry {len(out)} of {n} bytes does not fit the table")
        out.append(bytes(raw[pos + 2:pos + 2 + n]))
        pos += 2 + n
    if pos != len(raw):
        raise MalformedFrame(f"{len(raw) - pos} bytes after the last capability")
    return out
