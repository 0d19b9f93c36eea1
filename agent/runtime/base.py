"""The accelerator runtime seam: one small protocol, its value types and errors (standard library only).

Every implementation (sunrise, nvidia, host) is loaded on demand and fails
with ``RuntimeUnavailable`` carrying a one-line reason, so the loader can log
it and fall back. Nothing here may import third-party packages: the GPU check
script runs this on machines that have neither pydantic nor kubernetes.
"""

from __future__ import annotations

import ctypes
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from daybreak.errors import DaybreakError

Vendor = str  # "sunrise" | "nvidia" | "host"


class RuntimeUnavailable(DaybreakError):
    """A runtime could not be loaded on this node; ``reason`` is one line a human can act on."""

    def __init__(self, runtime: str, reason: str) -> None:
        super().__init__(f"{runtime}: {reason}")
        self.runtime = runtime
        self.reason = reason


class RuntimeCallError(DaybreakError, RuntimeError):
    """A runtime call returned an error code."""

    def __init__(self, *, function: str, code: int, message: str) -> None:
        super().__init__(f"{function} failed: {code} ({message})")
        self.function = function
        self.code = code
        self.message = message


class Unsupported(DaybreakError):
    """The operation does not exist on this runtime or device (for example dma-buf export)."""


@dataclass(frozen=True)
class DeviceInfo:
    """One accelerator as its runtime reports it."""

    index: int  # the runtime's ordinal (tangSetDevice / CUDA device number)
    pci_bus_id: str  # normalized: 4-digit domain, lower case, "0000:3b:00.0"
    memory_bytes: int
    vendor: Vendor
    model: str
    uuid: str = ""
    dmabuf: bool = False  # device memory can be exported as a dma-buf fd


@dataclass(frozen=True)
class PeerLink:
    """A direct device-to-device link bundle (Sunrise Link ports, NVLinks); ``links`` counts lanes."""

    a: int
    b: int
    links: int
    kind: str  # "SL" or "NV"


@dataclass(frozen=True)
class DeviceBuffer:
    """Device memory owned by a runtime; ``address`` is the device virtual address."""

    device: int
    address: int
    size: int
    extra: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)


@runtime_checkable
class AcceleratorRuntime(Protocol):
    """What the agent needs from a vendor runtime. Copies are synchronous; offsets are in bytes."""

    name: str

    def devices(self) -> Sequence[DeviceInfo]: ...

    def peer_links(self) -> Sequence[PeerLink]: ...

    def allocate(self, device: int, size: int) -> DeviceBuffer: ...

    def free(self, buffer: DeviceBuffer) -> None: ...

    def copy_to_device(self, dst: DeviceBuffer, src: Any, *, offset: int = 0) -> None: ...

    def copy_to_host(self, dst: Any, src: DeviceBuffer, *, offset: int = 0) -> None: ...

    def copy_device(self, dst: DeviceBuffer, src: DeviceBuffer, size: int, *,
                    dst_offset: int = 0, src_offset: int = 0) -> None: ...

    def ipc_handle(self, buffer: DeviceBuffer) -> bytes: ...

    def export_dmabuf(self, buffer: DeviceBuffer) -> int: ...

    def close(self) -> None: ...


@runtime_checkable
class HostRegistration(Protocol):
    """Optional part of a runtime: page-lock ("pin") a host range for DMA (cuMemHostRegister, tangHostRegister).

    A device-to-host or host-to-device copy into registered memory is one DMA; into pageable memory the
    driver goes through its own pinned bounce buffer. Callers register a range ONCE (a shared-memory segment
    when first mapped, a staging area when allocated) and never per copy: registering costs page faults
    and a pinning walk over the whole range. ``register_host`` raises ``Unsupported`` where the device or
    driver cannot, ``RuntimeCallError`` when the call fails (an overlapping range is an error, as in CUDA).
    """

    def register_host(self, address: int, size: int) -> None: ...

    def unregister_host(self, address: int) -> None: ...


_BUS_ID = re.compile(r"^(?:([0-9a-fA-F]{1,8}):)?([0-9a-fA-F]{1,2}):([0-9a-fA-F]{1,2})\.([0-7])$")


def normalize_bus_id(bus_id: str) -> str:
    """``00000000:3B:00.0`` (NVML), ``0000:3B:00.0`` (CUDA) and ``3b:00.0`` all become ``0000:3b:00.0``."""
    m = _BUS_ID.match(bus_id.strip().rstrip("\x00"))
    if not m:
        raise ValueError(f"pci_bus_id: not a PCI address: {bus_id!r}")
    domain = int(m.group(1) or "0", 16)
    return f"{domain:04x}:{int(m.group(2), 16):02x}:{int(m.group(3), 16):02x}.{m.group(4)}"


class HostPointer:
    """The address of a Python buffer for the duration of one foreign call.

    ``bytes`` are addressed in place (read-only use); writable buffers (bytearray,
    mmap, shared-memory segments, numpy arrays) through ``from_buffer``; other
    read-only buffers are copied once. Use as a context manager so the buffer
    export is released and an ``mmap`` can still be closed afterwards.
    """

    def __init__(self, buf: Any, *, writable: bool) -> None:
        self._keep: Any = None
        if isinstance(buf, bytes):
            if writable:
                raise TypeError("destination buffer is read-only (bytes)")
            self.nbytes = len(buf)
            self.address = ctypes.cast(ctypes.c_char_p(buf), ctypes.c_void_p).value or 0
            self._keep = buf
            return
        view = memoryview(buf)
        if not view.contiguous:
            raise ValueError("host buffer must be contiguous")
        if view.readonly:
            if writable:
                raise TypeError("destination buffer is read-only")
            data = bytes(view)
            self.nbytes = len(data)
            self.address = ctypes.cast(ctypes.c_char_p(data), ctypes.c_void_p).value or 0
            self._keep = data
            view.release()
            return
        flat = view.cast("B") if view.format != "B" or view.ndim != 1 else view
        self.nbytes = flat.nbytes
        self._keep = (ctypes.c_char * self.nbytes).from_buffer(flat) if self.nbytes else None
        self.address = ctypes.addressof(self._keep) if self._keep is not None else 0
        self._views = (view, flat)

    def __enter__(self) -> HostPointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self._keep = None
        for v in getattr(self, "_views", ()):
            v.release()


def check_range(buffer: DeviceBuffer, offset: int, size: int) -> None:
    """Refuse copies outside a device buffer before the runtime sees them."""
    if offset < 0 or size < 0 or offset + size > buffer.size:
        raise ValueError(f"offset: range [{offset}, {offset + size}) is outside the {buffer.size}-byte buffer")
