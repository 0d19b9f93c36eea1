"""One-sided access capabilities: what XLOCATE and XALLOC grant, minted and checked by one agent process alone.

A capability says: a connection scoped to ``claim`` may READ (or WRITE) bytes
``[offset, offset + length)`` of segment ``segment_id`` until ``expires`` (the
agent's monotonic clock), while grant ``grant`` (the XLOCATE lease or the XALLOC
reservation) lives. A MAC over every field, keyed with 32 random bytes the
agent draws at start and never sends, makes it unforgeable; the agent's
transfer-engine servers check it per request (docs/protocol.md, "One-sided
access: capabilities"). Nothing here names a transport: the same 68 bytes can
ride a tcp frame, an rdma control message or a device path's request.

Layout (network byte order)::

    version u8 | rights u8 | reserved u16 | grant u64 | expires_ms u64 | offset u64 | length u64
    | segment tag 8 | claim tag 8 | mac 16

Tags are BLAKE2b-64 of the segment id and of the scope claim (``ns:<name>``,
``admin``); the MAC is HMAC-SHA256 over everything before it, cut to 16 bytes.
A capability is opaque to the client: it hands back what the agent gave it.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass

VERSION = 1
READ, WRITE = 1, 2
_BODY = struct.Struct("!BBHQQQQ8s8s")
MAC_BYTES = 16
SIZE = _BODY.size + MAC_BYTES  # 68
ADMIN_CLAIM = "admin"  # a connection holding the pool secret may use any namespace's capability


def tag(text: str) -> bytes:
    """The 8-byte tag a capability carries for a segment id or a scope claim."""
    return hashlib.blake2b(text.encode(), digest_size=8).digest()


@dataclass(frozen=True, slots=True)
class Capability:
    """A decoded capability (its MAC not yet checked)."""

    rights: int
    grant: int
    expires_ms: int
    offset: int
    length: int
    segment: bytes
    claim: bytes
    mac: bytes

    @classmethod
    def decode(cls, raw: bytes | bytearray | memoryview) -> Capability | None:
        """None for anything that is not a version-1 capability of ``SIZE`` bytes."""
        if len(raw) != SIZE:
            return None
        version, rights, _, grant, expires_ms, offset, length, segment, claim = _BODY.unpack_from(raw)
        if version != VERSION:
            return None
        return cls(rights, grant, expires_ms, offset, length, segment, claim, bytes(raw[_BODY.size:]))


def _now_ms() -> int:
    return int(time.monotonic() * 1000)


class Authority:
    """The minting and checking key of one agent process: random, held in memory, never on the wire.

    A restarted agent has a new key, so every capability of the previous process is refused (its
    leases and reservations are gone with it anyway).
    """

    def __init__(self, key: bytes | None = None) -> None:
        self._key = key if key is not None else os.urandom(32)

    def _mac(self, body: bytes) -> bytes:
        return hmac.new(self._key, body, hashlib.sha256).digest()[:MAC_BYTES]

    def mint(self, *, segment_id: str, offset: int, length: int, rights: int, grant: int, expires: float,
             claim: str) -> bytes:
        """A capability for ``rights`` on the range; ``expires`` is a ``time.monotonic()`` deadline."""
        body = _BODY.pack(VERSION, rights, 0, grant, max(0, int(expires * 1000)), offset, length,
                          tag(segment_id), tag(claim))
        return body + self._mac(body)

    def check(self, raw: bytes | bytearray | memoryview | None, *, segment_id: str, offset: int, length: int,
              right: int, claim: str, live: Callable[[int, int], bool]) -> str:
        """'' when ``raw`` lets a connection scoped to ``claim`` use ``right`` on the range; else why not.

        ``live(grant, right)`` says whether the grant (lease for READ, reservation for WRITE) still
        exists: a released lease or a committed reservation revokes its capabilities before they expire.
        """
        if not raw:
            return (f"no capability for {'WRITE' if right == WRITE else 'READ'} of segment {segment_id}: "
                    "one-sided access needs the capability XLOCATE or XALLOC returned for the block")
        cap = Capability.decode(raw)
        if cap is None:
            return f"capability is not {SIZE} bytes of version {VERSION}"
        if not hmac.compare_digest(cap.mac, self._mac(bytes(raw[:_BODY.size]))):
            return "capability refused: its MAC does not verify (forged, altered or from another agent process)"
        if not cap.rights & right:
            return f"capability grants {'READ' if cap.rights == READ else 'WRITE'} only"
        if cap.segment != tag(segment_id):
            return f"capability is for another segment than {segment_id}"
        if offset < cap.offset or offset + length > cap.offset + cap.length:
            return (f"range {offset}+{length} is outside the capability's {cap.offset}+{cap.length} "
                    f"of segment {segment_id}")
        if claim != ADMIN_CLAIM and cap.claim != tag(claim):
            return f"capability was granted to another scope than this connection's ({claim})"
        if _now_ms() > cap.expires_ms:
            return f"capability expired (grant {cap.grant})"
        if not live(cap.grant, right):
            return f"capability revoked: grant {cap.grant} was released, committed or aborted"
        return ""
