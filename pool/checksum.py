"""Block checksums: CRC-32C over a block's bytes, computed by the writer and verified by the reader.

CRC-32C runs at memory speed with the SSE4.2/ARMv8 instruction (the
``crc32c`` wheel); without the wheel a table-driven fallback keeps results
identical but slow, so stored checksums never depend on what is installed.
"""

from __future__ import annotations

from typing import Any

# Anything exporting the buffer protocol (bytes, bytearray, memoryview, mmap, numpy arrays).
Buffer = Any

_crc32c: Any
try:
    import crc32c as _crc32c
except ImportError:  # pragma: no cover - exercised only where the wheel is missing
    _crc32c = None

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
