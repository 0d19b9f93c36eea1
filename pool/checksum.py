"""Block checksums: CRC-32C over a block's bytes, computed by the writer and verified by the reader.

CRC-32C runs at memory speed with the SSE4.2/ARMv8 instruction (the
``crc32c`` wheel); without the wheel a table-driven fallback keeps results
identical but slow, so stored checksums never depend on what is installed.
``copy_crc32c`` copies and checksums in one pass (the ``_copycrc`` extension,
built with the package where a compiler is present) for verified reads.
"""

from __future__ import annotations

import ctypes
import importlib
from typing import Any

# Anything exporting the buffer protocol (bytes, bytearray, memoryview, mmap, numpy arrays).
Buffer = Any

_crc32c: Any
try:
    import crc32c as _crc32c
except ImportError:  # pragma: no cover - exercised only where the wheel is missing
    _crc32c = None

_fused: Any
try:
    _fused = importlib.import_module("daybreak.pool._copycrc")  # the C extension (pool/_copycrc.c)
    if not _fused.HARDWARE:
        _fused = None
except ImportError:  # no compiler when the package was installed, or a bare source tree
    _fused = None

_TABLE: list[int] = []


def _slow_crc32c(data: Buffer, value: int = 0) -> int:
    if not _TABLE:
        for i in range(256):
            c = i
            for _ in range(8):
                c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
            _TABLE.append(c)
    crc = value ^ 0xFFFFFFFF
    for b in memoryview(data).cast("B"):
        crc = _TABLE[(crc ^ b) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def crc32c(data: Buffer, value: int = 0) -> int:
    """CRC-32C of ``data`` (continuing from ``value``), an unsigned 32-bit int."""
    if _crc32c is not None:
        return int(_crc32c.crc32c(data, value))
    return _slow_crc32c(data, value)


def fast() -> bool:
    """Whether checksums run at hardware speed here."""
    return _crc32c is not None and bool(getattr(_crc32c, "hardware_based", True))


def copy_crc32c(dst: memoryview, src: memoryview) -> int:
    """Copy ``src`` into the start of ``dst`` and return the CRC-32C of the bytes ``dst`` now holds.

    The checksum always covers what was stored into ``dst`` (never a second read of ``src``), so a
    writer racing the copy shows up as a mismatch. One pass with the extension (each word is
    loaded once, stored and checksummed from the same register); else a copy, then a checksum of
    ``dst`` while it is still in cache. Both release the GIL.
    """
    n = len(src)
    if len(dst) < n:
        raise ValueError(f"copy_crc32c: destination holds {len(dst)} bytes, source {n}")
    if _fused is not None:
        return int(_fused.copy_crc32c(dst, src))
    if n:
        ctypes.memmove((ctypes.c_char * n).from_buffer(dst), (ctypes.c_char * n).from_buffer(src), n)
    return crc32c(dst[:n])


def fused() -> bool:
    """Whether ``copy_crc32c`` runs as one pass here (the extension with the hardware instruction)."""
    return _fused is not None
