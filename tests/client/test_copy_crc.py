"""The fused copy + CRC-32C of verified same-node reads: same checksum as the crc32c wheel, of the bytes stored."""

from __future__ import annotations

import ctypes
import threading

import numpy as np
import pytest

from daybreak.pool import checksum
from daybreak.pool.checksum import copy_crc32c, crc32c


@pytest.fixture(params=["fused", "fallback"])
def kernel(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "fallback":
        monkeypatch.setattr(checksum, "_fused", None)
    else:
        assert checksum.fused(), "the _copycrc extension did not build or finds no SSE4.2 (pip install -e .)"
    return str(request.param)


# Around the kernel's 3 x 8 KiB stride, odd tails and offsets, and a whole block.
SIZES = [0, 1, 7, 8, 9, 4095, 24575, 24576, 24577, 3 * 24576 + 13, 1 << 20, (1 << 20) + 5]


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("offset", [0, 3])
def test_copy_crc32c_copies_and_matches_the_wheel(kernel: str, size: int, offset: int) -> None:
    raw = np.random.default_rng(size).integers(0, 256, size + 8, dtype=np.uint8)
    src = memoryview(raw)[offset:offset + size]
    dst = memoryview(bytearray(size + 16))
    assert copy_crc32c(dst[offset:], src) == crc32c(src)
    assert bytes(dst[offset:offset + size]) == bytes(src)
    assert bytes(dst[offset + size:]) == bytes(16 - offset)  # nothing past the copy is touched


def test_copy_crc32c_refuses_a_short_destination(kernel: str) -> None:
    with pytest.raises(ValueError, match="destination"):
        copy_crc32c(memoryview(bytearray(10)), memoryview(bytes(11)))


def test_the_checksum_covers_the_bytes_stored_while_a_writer_races_the_copy(kernel: str) -> None:
    # A writer flips the source between two patterns while blocks are copied out of it: whatever
    # mixture lands in the destination, the returned CRC is the CRC of that mixture, so a torn
    # block never verifies against its writer's checksum by accident.
    size = 1 << 20
    src = np.zeros(size, np.uint8)
    patterns = [np.full(size, 0x5A, np.uint8), np.full(size, 0xA5, np.uint8)]
    stop = threading.Event()

    def writer() -> None:
        k = 0
        while not stop.is_set():
            ctypes.memmove(src.ctypes.data, patterns[k % 2].ctypes.data, size)  # drops the GIL
            k += 1

    thread = threading.Thread(target=writer)
    thread.start()
    torn = 0
    try:
        dst = np.zeros(size, np.uint8)
        for _ in range(50):
            got = copy_crc32c(memoryview(dst), memoryview(src))
            assert got == crc32c(dst)
            torn += len(np.unique(dst)) > 1
    finally:
        stop.set()
        thread.join()
    assert crc32c(patterns[0]) != crc32c(patterns[1])
    print(f"torn copies seen: {torn} of 50")
