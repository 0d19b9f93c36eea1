"""The Sunrise runtime: ctypes over libtangrt_shared.so (Tang) and libptml_shared.so (PTML).

Signatures follow the public ``ptml.h`` and the CUDA-like Tang API as
Mooncake's Sunrise Link transport calls it. Sunrise Link topology comes from
``ptmlPtlinkPhytopoDetect``; like Mooncake we take a PTML chip id to be the
Tang device ordinal. The library directory is, in order: the
``sunrise_lib_dir`` setting, ``DAYBREAK_SUNRISE_LIB_DIR``, then the Tang RT
install paths Mooncake uses, then the dynamic loader's search path.
Standard library only (see base.py).
"""

from __future__ import annotations

import ctypes
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from daybreak.agent.runtime.base import (
    DeviceBuffer,
    DeviceInfo,
    HostPointer,
    PeerLink,
    RuntimeCallError,
    RuntimeUnavailable,
    Unsupported,
    check_range,
    normalize_bus_id,
)

log = logging.getLogger(__name__)

TANG_LIBRARY = "libtangrt_shared.so"
PTML_LIBRARY = "libptml_shared.so"
ENV_LIB_DIR = "DAYBREAK_SUNRISE_LIB_DIR"
DEFAULT_DIRS = ("/usr/local/tangrt/lib/linux-x86_64", "/usr/local/tangrt/lib")
PHYTOPO_PORTS = 10  # entries Mooncake passes to ptmlPtlinkPhytopoDetect; ptml.h lists 10 C2C ports

# tangMemcpyKind
H2D, D2H, D2D = 1, 2, 3
HOST_REGISTER_PORTABLE = 1  # as cudaHostRegisterPortable: pinned for every device, not just the current one
PTML_ERRORS = ("PTML_SUCCESS", "PTML_ERROR_UNINITIALIZED", "PTML_ERROR_INVALID_ARGUMENT",
               "PTML_ERROR_ALREADY_INITIALIZED", "PTML_ERROR_INSUFFICIENT_SIZE", "PTML_ERROR_IN_USE",
               "PTML_ERROR_DRIVER_NOT_LOADED", "PTML_ERROR_DEVICE_NOT_FOUND", "PTML_ERROR_EVENT_TIMEOUT",
               "PTML_ERROR_UNKNOWN")


class PtPhyTopo(ctypes.Structure):
    """``ptPhyTopo_t``: one Sunrise Link port as PTML reports it."""

    _fields_ = [(name, ctypes.c_ubyte) for name in (
        "local_chipid", "local_port", "remote_chipid", "remote_port", "link_status", "isBif",
        "max_speed", "cur_speed", "max_bandwidth", "cur_bandwidth")]


class PtMemory(ctypes.Structure):
    _fields_ = [("total", ctypes.c_size_t), ("used", ctypes.c_size_t), ("free", ctypes.c_size_t)]


class TangPointerAttributes(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("device", ctypes.c_int),
                ("devicePointer", ctypes.c_void_p), ("hostPointer", ctypes.c_void_p)]


class TangIpcMemHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * 64)]


_c_int_p = ctypes.POINTER(ctypes.c_int)
_TANG_SIGNATURES: dict[str, tuple[Any, list[Any]]] = {
    "tangGetErrorString": (ctypes.c_char_p, [ctypes.c_int]),
    "tangGetDeviceCount": (ctypes.c_int, [_c_int_p]),
    "tangSetDevice": (ctypes.c_int, [ctypes.c_int]),
    "tangDeviceGetPCIBusId": (ctypes.c_int, [ctypes.c_char_p, ctypes.c_int, ctypes.c_int]),
    "tangMalloc": (ctypes.c_int, [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t]),
    "tangFree": (ctypes.c_int, [ctypes.c_void_p]),
    "tangMemcpy": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]),
    "tangMemcpyPeer": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_int,
                                      ctypes.c_size_t]),
    "tangPointerGetAttributes": (ctypes.c_int, [ctypes.POINTER(TangPointerAttributes), ctypes.c_void_p]),
    "tangIpcGetMemHandle": (ctypes.c_int, [ctypes.POINTER(TangIpcMemHandle), ctypes.c_void_p]),
}
_TANG_OPTIONAL: dict[str, tuple[Any, list[Any]]] = {
    "tangMemGetInfo": (ctypes.c_int, [ctypes.POINTER(ctypes.c_size_t), ctypes.POINTER(ctypes.c_size_t)]),
    "tangIpcOpenMemHandle": (ctypes.c_int, [ctypes.POINTER(ctypes.c_void_p), TangIpcMemHandle, ctypes.c_uint]),
    "tangIpcCloseMemHandle": (ctypes.c_int, [ctypes.c_void_p]),
    "tangDeviceGetPeerPointer": (ctypes.c_int, [ctypes.c_int, ctypes.c_int, ctypes.c_void_p,
                                                ctypes.POINTER(ctypes.c_void_p)]),
    # page-locking host memory for DMA (CUDA-like cudaHostRegister); absent: copies from pageable memory
    "tangHostRegister": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]),
    "tangHostUnregister": (ctypes.c_int, [ctypes.c_void_p]),
}
_PTML_SIGNATURES: dict[str, tuple[Any, list[Any]]] = {
    "ptmlInit": (ctypes.c_int, []),
    "ptmlDeviceGetCount": (ctypes.c_int, [_c_int_p]),
    "ptmlPtlinkEnableAll": (ctypes.c_int, []),
    "ptmlPtlinkPhytopoDetect": (ctypes.c_int, [ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p]),
}
_PTML_OPTIONAL: dict[str, tuple[Any, list[Any]]] = {
    "ptmlDeviceGetMemoryInfo": (ctypes.c_int, [ctypes.c_int, ctypes.POINTER(PtMemory)]),
    "ptmlDeviceGetBrand": (ctypes.c_int, [ctypes.c_int, ctypes.c_char_p]),
    "ptmlDeviceGetUUID": (ctypes.c_int, [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]),
    "ptmlGetErrorCodeToDescription": (ctypes.c_char_p, [ctypes.c_int]),
}


def library_dirs(lib_dir: str = "") -> list[str]:
    """Where to look, in order; an explicit setting or variable is the only place looked."""
    explicit = lib_dir or os.environ.get(ENV_LIB_DIR, "")
    if explicit:
        return [explicit]
    return [*DEFAULT_DIRS, ""]  # "" = let the dynamic loader search (LD_LIBRARY_PATH, ld.so.cache)


def _bind(lib: ctypes.CDLL, table: dict[str, tuple[Any, list[Any]]], *, required: bool,
          libname: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, (restype, argtypes) in table.items():
        try:
            fn = getattr(lib, name)
        except AttributeError:
            if required:
                raise RuntimeUnavailable("sunrise", f"{libname} lacks symbol {name}") from None
            continue
        fn.restype, fn.argtypes = restype, argtypes
        out[name] = fn
    return out


def _open(dirs: list[str], libname: str) -> tuple[ctypes.CDLL, str]:
    errors = []
    for d in dirs:
        path = str(Path(d) / libname) if d else libname
        if d and not Path(path).exists():
            errors.append(f"{path}: not found")
            continue
        try:
            return ctypes.CDLL(path), path
        except OSError as exc:
            errors.append(str(exc))
    raise RuntimeUnavailable("sunrise", f"cannot load {libname}: " + "; ".join(errors))


class SunriseRuntime:
    """A loaded Tang + PTML pair with its devices and Sunrise Link topology."""

    name = "sunrise"

    def __init__(self, *, tang: dict[str, Any], ptml: dict[str, Any], paths: tuple[str, str],
                 devices: list[DeviceInfo], links: list[PeerLink]) -> None:
        self._tang = tang
        self._ptml = ptml
        self.paths = paths
        self._devices = devices
        self._links = links
        self.host_registrations = 0  # ranges page-locked by register_host (tests assert once, not per move)

    # -- loading ------------------------------------------------------------------
    @classmethod
    def load(cls, *, lib_dir: str = "") -> SunriseRuntime:
        """Open both libraries and enumerate; raises RuntimeUnavailable with the failed step."""
        dirs = library_dirs(lib_dir)
        ptml_lib, ptml_path = _open(dirs, PTML_LIBRARY)
        ptml = _bind(ptml_lib, _PTML_SIGNATURES, required=True, libname=PTML_LIBRARY)
        ptml.update(_bind(ptml_lib, _PTML_OPTIONAL, required=False, libname=PTML_LIBRARY))
        rc = ptml["ptmlInit"]()
        if rc != 0:
            raise RuntimeUnavailable("sunrise", f"ptmlInit returned {rc} ({_ptml_error(ptml, rc)})")
        rc = ptml["ptmlPtlinkEnableAll"]()
        if rc != 0:
            # Not fatal (Mooncake only warns): links may simply be down; detection below says which.
            log.warning("runtime=sunrise step=ptmlPtlinkEnableAll rc=%d reason=%r", rc, _ptml_error(ptml, rc))
        tang_lib, tang_path = _open(dirs, TANG_LIBRARY)
        tang = _bind(tang_lib, _TANG_SIGNATURES, required=True, libname=TANG_LIBRARY)
        tang.update(_bind(tang_lib, _TANG_OPTIONAL, required=False, libname=TANG_LIBRARY))
        count = ctypes.c_int(0)
        rc = tang["tangGetDeviceCount"](ctypes.byref(count))
        if rc != 0:
            raise RuntimeUnavailable("sunrise", f"tangGetDeviceCount returned {rc} ({_tang_error(tang, rc)})")
        if count.value <= 0:
            raise RuntimeUnavailable("sunrise", "tangGetDeviceCount reports zero devices")
        devices = [_describe(tang, ptml, i) for i in range(count.value)]
        links = _detect_links(ptml, count.value)
        return cls(tang=tang, ptml=ptml, paths=(tang_path, ptml_path), devices=devices, links=links)

    # -- the protocol ---------------------------------------------------------------
    def devices(self) -> Sequence[DeviceInfo]:
        return tuple(self._devices)

    def peer_links(self) -> Sequence[PeerLink]:
        return tuple(self._links)

    def _call(self, name: str, *args: Any) -> None:
        rc = self._tang[name](*args)
        if rc != 0:
            raise RuntimeCallError(function=name, code=rc, message=_tang_error(self._tang, rc))

    def _device_index(self, device: int) -> None:
        if not 0 <= device < len(self._devices):
            raise ValueError(f"device: {device} is not one of the {len(self._devices)} Sunrise devices")

    def allocate(self, device: int, size: int) -> DeviceBuffer:
        self._device_index(device)
        if size <= 0:
            raise ValueError(f"size: must be positive, got {size}")
        ptr = ctypes.c_void_p()
        self._call("tangSetDevice", device)
        self._call("tangMalloc", ctypes.byref(ptr), size)
        return DeviceBuffer(device=device, address=ptr.value or 0, size=size)

    def free(self, buffer: DeviceBuffer) -> None:
        self._call("tangSetDevice", buffer.device)
        self._call("tangFree", ctypes.c_void_p(buffer.address))

    def copy_to_device(self, dst: DeviceBuffer, src: Any, *, offset: int = 0) -> None:
        with HostPointer(src, writable=False) as host:
            check_range(dst, offset, host.nbytes)
            self._call("tangSetDevice", dst.device)
            self._call("tangMemcpy", ctypes.c_void_p(dst.address + offset), ctypes.c_void_p(host.address),
                       host.nbytes, H2D)

    def copy_to_host(self, dst: Any, src: DeviceBuffer, *, offset: int = 0) -> None:
        with HostPointer(dst, writable=True) as host:
            check_range(src, offset, host.nbytes)
            self._call("tangSetDevice", src.device)
            self._call("tangMemcpy", ctypes.c_void_p(host.address), ctypes.c_void_p(src.address + offset),
                       host.nbytes, D2H)

    def copy_device(self, dst: DeviceBuffer, src: DeviceBuffer, size: int, *,
                    dst_offset: int = 0, src_offset: int = 0) -> None:
        check_range(dst, dst_offset, size)
        check_range(src, src_offset, size)
        d, s = ctypes.c_void_p(dst.address + dst_offset), ctypes.c_void_p(src.address + src_offset)
        if dst.device == src.device:
            self._call("tangSetDevice", dst.device)
            self._call("tangMemcpy", d, s, size, D2D)
        else:
            self._call("tangMemcpyPeer", d, dst.device, s, src.device, size)

    def pointer_device(self, address: int) -> int | None:
        """The device owning ``address`` (tangPointerGetAttributes), or None for host memory."""
        attrs = TangPointerAttributes()
        self._call("tangPointerGetAttributes", ctypes.byref(attrs), ctypes.c_void_p(address))
        return attrs.device if attrs.type == 2 else None

    def ipc_handle(self, buffer: DeviceBuffer) -> bytes:
        handle = TangIpcMemHandle()
        self._call("tangSetDevice", buffer.device)
        self._call("tangIpcGetMemHandle", ctypes.byref(handle), ctypes.c_void_p(buffer.address))
        return bytes(ctypes.string_at(ctypes.addressof(handle), ctypes.sizeof(handle)))

    def open_ipc_handle(self, handle: bytes, *, device: int, size: int) -> DeviceBuffer:
        """Map another process's device buffer (tangIpcOpenMemHandle)."""
        if "tangIpcOpenMemHandle" not in self._tang:
            raise Unsupported("libtangrt_shared.so lacks tangIpcOpenMemHandle")
        h = TangIpcMemHandle()
        ctypes.memmove(ctypes.addressof(h), handle, min(len(handle), ctypes.sizeof(h)))
        ptr = ctypes.c_void_p()
        self._call("tangSetDevice", device)
        self._call("tangIpcOpenMemHandle", ctypes.byref(ptr), h, 1)
        return DeviceBuffer(device=device, address=ptr.value or 0, size=size, extra={"imported": True})

    def close_ipc_handle(self, buffer: DeviceBuffer) -> None:
        self._call("tangIpcCloseMemHandle", ctypes.c_void_p(buffer.address))

    def register_host(self, address: int, size: int) -> None:
        """Page-lock ``size`` bytes at ``address`` for DMA (tangHostRegister, portable flag)."""
        if "tangHostRegister" not in self._tang:
            raise Unsupported("libtangrt_shared.so lacks tangHostRegister")
        if size <= 0:
            raise ValueError(f"size: must be positive, got {size}")
        self._call("tangHostRegister", ctypes.c_void_p(address), size, HOST_REGISTER_PORTABLE)
        self.host_registrations += 1

    def unregister_host(self, address: int) -> None:
        if "tangHostUnregister" not in self._tang:
            raise Unsupported("libtangrt_shared.so lacks tangHostUnregister")
        self._call("tangHostUnregister", ctypes.c_void_p(address))

    def export_dmabuf(self, buffer: DeviceBuffer) -> int:
        raise Unsupported("the Tang runtime API we bind has no dma-buf export; Sunrise GDR needs a peer-memory client")

    def close(self) -> None:
        # Like Mooncake, never dlclose: reloading Tang/PTML after dlclose is not safe.
        return None


def _tang_error(tang: dict[str, Any], rc: int) -> str:
    raw = tang["tangGetErrorString"](rc) if "tangGetErrorString" in tang else None
    return raw.decode(errors="replace") if raw else f"tang error {rc}"


def _ptml_error(ptml: dict[str, Any], rc: int) -> str:
    name = PTML_ERRORS[rc] if 0 <= rc < len(PTML_ERRORS) else f"PTML error {rc}"
    fn = ptml.get("ptmlGetErrorCodeToDescription")
    text = fn(rc) if fn else None
    return f"{name}: {text.decode(errors='replace')}" if text else name


def _describe(tang: dict[str, Any], ptml: dict[str, Any], index: int) -> DeviceInfo:
    buf = ctypes.create_string_buffer(64)
    rc = tang["tangDeviceGetPCIBusId"](buf, len(buf), index)
    if rc != 0:
        raise RuntimeUnavailable("sunrise", f"tangDeviceGetPCIBusId({index}) returned {rc} ({_tang_error(tang, rc)})")
    try:
        bus_id = normalize_bus_id(buf.value.decode())
    except ValueError as exc:
        raise RuntimeUnavailable("sunrise", f"device {index}: {exc}") from None
    memory = 0
    if "ptmlDeviceGetMemoryInfo" in ptml:
        mem = PtMemory()
        if ptml["ptmlDeviceGetMemoryInfo"](index, ctypes.byref(mem)) == 0:
            memory = int(mem.total)
    if not memory and "tangMemGetInfo" in tang and tang["tangSetDevice"](index) == 0:
        free, total = ctypes.c_size_t(), ctypes.c_size_t()
        if tang["tangMemGetInfo"](ctypes.byref(free), ctypes.byref(total)) == 0:
            memory = int(total.value)
    model = "Sunrise"
    if "ptmlDeviceGetBrand" in ptml:
        brand = ctypes.create_string_buffer(256)  # ptml.h gives no length; be generous
        if ptml["ptmlDeviceGetBrand"](index, brand) == 0 and brand.value:
            model = brand.value.decode(errors="replace")
    uuid = ""
    if "ptmlDeviceGetUUID" in ptml:
        ubuf = ctypes.create_string_buffer(96)
        if ptml["ptmlDeviceGetUUID"](index, ubuf, len(ubuf)) == 0:
            uuid = ubuf.value.decode(errors="replace")
    return DeviceInfo(index=index, pci_bus_id=bus_id, memory_bytes=memory, vendor="sunrise", model=model,
                      uuid=uuid, dmabuf=False)


def _detect_links(ptml: dict[str, Any], count: int) -> list[PeerLink]:
    """Active Sunrise Link ports per device pair; a pair's count is the most ports either side reports."""
    ports: dict[tuple[int, int], int] = {}
    for dev in range(count):
        table = (PtPhyTopo * PHYTOPO_PORTS)()
        rc = ptml["ptmlPtlinkPhytopoDetect"](dev, ctypes.sizeof(table), ctypes.addressof(table))
        if rc != 0:
            log.warning("runtime=sunrise step=ptmlPtlinkPhytopoDetect device=%d rc=%d reason=%r",
                        dev, rc, _ptml_error(ptml, rc))
            continue
        seen: dict[int, int] = {}
        for entry in table:
            if not entry.link_status or entry.remote_chipid == dev or entry.remote_chipid >= count:
                continue
            seen[entry.remote_chipid] = seen.get(entry.remote_chipid, 0) + 1
        for remote, n in seen.items():
            key = (min(dev, remote), max(dev, remote))
            ports[key] = max(ports.get(key, 0), n)
    return [PeerLink(a=a, b=b, links=n, kind="SL") for (a, b), n in sorted(ports.items())]
