"""The NVIDIA runtime: NVML (nvidia-ml-py) for enumeration and NVLink, the CUDA driver API via ctypes for memory.

Allocation, copies, IPC handles and dma-buf export go through ``libcuda.so.1``
directly (no CUDA toolkit, no cuda-python). Device ordinals are CUDA's, so
``CUDA_VISIBLE_DEVICES`` is honoured; NVML data is joined on the PCI bus id.
pynvml is imported inside ``load`` only: this module must import on machines
without it (and without pydantic or kubernetes: see base.py).
"""

from __future__ import annotations

import ctypes
import logging
import mmap
from collections.abc import Iterable, Sequence
from types import ModuleType
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

CUDA_LIBRARY = "libcuda.so.1"
CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED = 124
CU_POINTER_ATTRIBUTE_SYNC_MEMOPS = 6
CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD = 1
CU_MEMHOSTREGISTER_PORTABLE = 1  # pinned for every context, not just the current one
NVLINK_MAX_LINKS = 18  # NVML_NVLINK_MAX_LINKS in current drivers (H100/H200: 18 links)
NVLINK_DEVICE_TYPE_SWITCH = 2

CUdeviceptr = ctypes.c_uint64
_cu_ptr = ctypes.POINTER

_CUDA_SIGNATURES: dict[str, list[Any]] = {
    "cuInit": [ctypes.c_uint],
    "cuDriverGetVersion": [_cu_ptr(ctypes.c_int)],
    "cuDeviceGetCount": [_cu_ptr(ctypes.c_int)],
    "cuDeviceGet": [_cu_ptr(ctypes.c_int), ctypes.c_int],
    "cuDeviceGetPCIBusId": [ctypes.c_char_p, ctypes.c_int, ctypes.c_int],
    "cuDeviceGetAttribute": [_cu_ptr(ctypes.c_int), ctypes.c_int, ctypes.c_int],
    "cuDeviceTotalMem_v2": [_cu_ptr(ctypes.c_size_t), ctypes.c_int],
    "cuDeviceGetName": [ctypes.c_char_p, ctypes.c_int, ctypes.c_int],
    "cuDevicePrimaryCtxRetain": [_cu_ptr(ctypes.c_void_p), ctypes.c_int],
    "cuDevicePrimaryCtxRelease_v2": [ctypes.c_int],
    "cuCtxSetCurrent": [ctypes.c_void_p],
    "cuCtxSynchronize": [],
    "cuMemAlloc_v2": [_cu_ptr(CUdeviceptr), ctypes.c_size_t],
    "cuMemFree_v2": [CUdeviceptr],
    "cuMemcpyHtoD_v2": [CUdeviceptr, ctypes.c_void_p, ctypes.c_size_t],
    "cuMemcpyDtoH_v2": [ctypes.c_void_p, CUdeviceptr, ctypes.c_size_t],
    "cuMemcpyDtoD_v2": [CUdeviceptr, CUdeviceptr, ctypes.c_size_t],
    "cuMemcpyPeer": [CUdeviceptr, ctypes.c_void_p, CUdeviceptr, ctypes.c_void_p, ctypes.c_size_t],
    "cuIpcGetMemHandle": [ctypes.c_void_p, CUdeviceptr],
    "cuPointerSetAttribute": [ctypes.c_void_p, ctypes.c_int, CUdeviceptr],
    "cuGetErrorName": [ctypes.c_int, _cu_ptr(ctypes.c_char_p)],
}


class CUipcMemHandle(ctypes.Structure):
    """``CUipcMemHandle``: 64 opaque bytes, passed BY VALUE to cuIpcOpenMemHandle."""

    _fields_ = [("reserved", ctypes.c_char * 64)]


CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS = 1

# Absent before CUDA 11.7 drivers: then dma-buf export is Unsupported, not a load failure.
# The IPC open/close pair makes the link transport work between processes; without it the
# link is Unsupported for remote segments and transfers fall back to shm/tcp.
_CUDA_OPTIONAL: dict[str, list[Any]] = {
    "cuMemGetHandleForAddressRange": [ctypes.c_void_p, CUdeviceptr, ctypes.c_size_t, ctypes.c_int,
                                      ctypes.c_ulonglong],
    "cuIpcOpenMemHandle_v2": [_cu_ptr(CUdeviceptr), CUipcMemHandle, ctypes.c_uint],
    "cuIpcCloseMemHandle": [CUdeviceptr],
    # page-locking host memory for DMA (cudaHostRegister's driver call); absent: copies from pageable memory
    "cuMemHostRegister_v2": [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint],
    "cuMemHostUnregister": [ctypes.c_void_p],
}


class CudaDriver:
    """The few libcuda entry points we use, with errors turned into RuntimeCallError."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.fns: dict[str, Any] = {}
        for table, required in ((_CUDA_SIGNATURES, True), (_CUDA_OPTIONAL, False)):
            for name, argtypes in table.items():
                try:
                    fn = getattr(lib, name)
                except AttributeError:
                    if required:
                        raise RuntimeUnavailable("nvidia", f"{CUDA_LIBRARY} lacks symbol {name}") from None
                    continue
                fn.restype, fn.argtypes = ctypes.c_int, argtypes
                self.fns[name] = fn

    def has(self, name: str) -> bool:
        return name in self.fns

    def error_name(self, rc: int) -> str:
        text = ctypes.c_char_p()
        if self.fns["cuGetErrorName"](rc, ctypes.byref(text)) == 0 and text.value:
            return text.value.decode()
        return f"CUDA error {rc}"

    def __call__(self, name: str, *args: Any) -> None:
        rc = self.fns[name](*args)
        if rc != 0:
            raise RuntimeCallError(function=name, code=rc, message=self.error_name(rc))


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def nvlink_peer_links(ports: dict[str, list[tuple[str, int]]], index_of: dict[str, int]) -> list[PeerLink]:
    """NV<n> bundles from per-GPU NVLink ports: ``{gpu_bus_id: [(remote_bus_id, remote_type), ...]}``.

    A link to another GPU counts for that pair. Links to NVSwitches connect
    every pair of switch-attached GPUs, with the smaller of the two GPUs'
    switch-link counts (what ``nvidia-smi topo -m`` shows as NV18 on HGX H100).
    """
    seen: dict[tuple[int, int], int] = {}  # (from, to) -> links counted at "from"
    to_switch: dict[int, int] = {}
    for bus, remotes in ports.items():
        if bus not in index_of:
            continue
        a = index_of[bus]
        for remote, kind in remotes:
            if kind == NVLINK_DEVICE_TYPE_SWITCH:
                to_switch[a] = to_switch.get(a, 0) + 1
            elif remote in index_of and index_of[remote] != a:
                seen[(a, index_of[remote])] = seen.get((a, index_of[remote]), 0) + 1
    # Each direct link is seen from both ends: a pair's bundle is what either end counts.
    bundles: dict[tuple[int, int], int] = {}
    for (a, b), n in seen.items():
        key = (min(a, b), max(a, b))
        bundles[key] = max(bundles.get(key, 0), n)
    switched = sorted(to_switch)
    for i, a in enumerate(switched):
        for b in switched[i + 1:]:
            bundles[(a, b)] = bundles.get((a, b), 0) + min(to_switch[a], to_switch[b])
    return [PeerLink(a=a, b=b, links=n, kind="NV") for (a, b), n in sorted(bundles.items()) if n > 0]


def _nvlink_ports(nvml: ModuleType, handle: Any) -> list[tuple[str, int]]:
    remotes: list[tuple[str, int]] = []
    for link in range(NVLINK_MAX_LINKS):
        try:
            if nvml.nvmlDeviceGetNvLinkState(handle, link) != 1:  # NVML_FEATURE_ENABLED
                continue
            getter = getattr(nvml, "nvmlDeviceGetNvLinkRemotePciInfo_v2", None) or \
                nvml.nvmlDeviceGetNvLinkRemotePciInfo
            remote = normalize_bus_id(_text(getter(handle, link).busId))
            kind = 0
            type_getter = getattr(nvml, "nvmlDeviceGetNvLinkRemoteDeviceType", None)
            if type_getter is not None:
                kind = int(type_getter(handle, link))
            remotes.append((remote, kind))
        except nvml.NVMLError:
            # NotSupported on the first link means no NVLink at all; later ones are just absent.
            if link == 0:
                break
            continue
        except ValueError:
            continue
    return remotes


class NvidiaRuntime:
    """CUDA devices with NVML details; one primary context per device, retained on first use."""

    name = "nvidia"

    def __init__(self, *, cuda: CudaDriver, nvml: ModuleType | None, devices: list[DeviceInfo],
                 ordinals: list[int], links: list[PeerLink], driver_version: int) -> None:
        self._cu = cuda
        self._nvml = nvml
        self._devices = devices
        self._ordinals = ordinals  # CUdevice per index
        self._links = links
        self._contexts: dict[int, int] = {}
        self.driver_version = driver_version
        self.host_registrations = 0  # ranges page-locked by register_host

    @classmethod
    def load(cls, *, nvml_module: ModuleType | None = None, cuda_library: str = CUDA_LIBRARY) -> NvidiaRuntime:
        """NVML first (enumeration), then the CUDA driver; raises RuntimeUnavailable naming the failed step."""
        nvml = nvml_module
        if nvml is None:
            try:
                import pynvml as nvml_imported
            except ImportError as exc:
                raise RuntimeUnavailable("nvidia", f"nvidia-ml-py not installed ({exc}); "
                                                   "install daybreak[nvidia]") from None
            nvml = nvml_imported
        try:
            nvml.nvmlInit()
        except nvml.NVMLError as exc:
            raise RuntimeUnavailable("nvidia", f"nvmlInit failed: {exc}") from None
        try:
            count = int(nvml.nvmlDeviceGetCount())
            if count <= 0:
                raise RuntimeUnavailable("nvidia", "NVML reports zero devices")
            nvml_by_bus: dict[str, Any] = {}
            for i in range(count):
                handle = nvml.nvmlDeviceGetHandleByIndex(i)
                nvml_by_bus[normalize_bus_id(_text(nvml.nvmlDeviceGetPciInfo(handle).busId))] = handle
        except nvml.NVMLError as exc:
            raise RuntimeUnavailable("nvidia", f"NVML enumeration failed: {exc}") from None
        try:
            cuda = CudaDriver(ctypes.CDLL(cuda_library))
        except OSError as exc:
            raise RuntimeUnavailable("nvidia", f"cannot load {cuda_library}: {exc}") from None
        try:
            cuda("cuInit", 0)
            version, n = ctypes.c_int(), ctypes.c_int()
            cuda("cuDriverGetVersion", ctypes.byref(version))
            cuda("cuDeviceGetCount", ctypes.byref(n))
        except RuntimeCallError as exc:
            raise RuntimeUnavailable("nvidia", str(exc)) from None
        if n.value <= 0:
            raise RuntimeUnavailable("nvidia", "CUDA reports zero visible devices")
        devices, ordinals, ports = [], [], {}
        for index in range(n.value):
            dev = ctypes.c_int()
            cuda("cuDeviceGet", ctypes.byref(dev), index)
            buf = ctypes.create_string_buffer(64)
            cuda("cuDeviceGetPCIBusId", buf, len(buf), dev.value)
            bus = normalize_bus_id(buf.value.decode())
            dmabuf = ctypes.c_int(0)
            try:
                cuda("cuDeviceGetAttribute", ctypes.byref(dmabuf), CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED, dev.value)
            except RuntimeCallError:
                dmabuf.value = 0  # attribute unknown to an old driver
            handle = nvml_by_bus.get(bus)
            if handle is not None:
                memory = int(nvml.nvmlDeviceGetMemoryInfo(handle).total)
                model = _text(nvml.nvmlDeviceGetName(handle))
                uuid = _text(nvml.nvmlDeviceGetUUID(handle))
                ports[bus] = _nvlink_ports(nvml, handle)
            else:
                total, name = ctypes.c_size_t(), ctypes.create_string_buffer(128)
                cuda("cuDeviceTotalMem_v2", ctypes.byref(total), dev.value)
                cuda("cuDeviceGetName", name, len(name), dev.value)
                memory, model, uuid = int(total.value), name.value.decode(), ""
            devices.append(DeviceInfo(index=index, pci_bus_id=bus, memory_bytes=memory, vendor="nvidia",
                                      model=model, uuid=uuid,
                                      dmabuf=bool(dmabuf.value) and cuda.has("cuMemGetHandleForAddressRange")))
            ordinals.append(dev.value)
        links = nvlink_peer_links(ports, {d.pci_bus_id: d.index for d in devices})
        return cls(cuda=cuda, nvml=nvml, devices=devices, ordinals=ordinals, links=links,
                   driver_version=version.value)

    # -- the protocol ---------------------------------------------------------------
    def devices(self) -> Sequence[DeviceInfo]:
        return tuple(self._devices)

    def peer_links(self) -> Sequence[PeerLink]:
        return tuple(self._links)

    def _use(self, device: int) -> int:
        """Make ``device``'s primary context current in this thread (cheap; each ctypes caller may differ)."""
        if not 0 <= device < len(self._devices):
            raise ValueError(f"device: {device} is not one of the {len(self._devices)} CUDA devices")
        ctx = self._contexts.get(device)
        if ctx is None:
            handle = ctypes.c_void_p()
            self._cu("cuDevicePrimaryCtxRetain", ctypes.byref(handle), self._ordinals[device])
            ctx = self._contexts[device] = handle.value or 0
        self._cu("cuCtxSetCurrent", ctypes.c_void_p(ctx))
        return ctx

    def allocate(self, device: int, size: int) -> DeviceBuffer:
        """Device memory rounded up to the host page size, so the whole buffer can be a dma-buf."""
        if size <= 0:
            raise ValueError(f"size: must be positive, got {size}")
        self._use(device)
        size = -(-size // mmap.PAGESIZE) * mmap.PAGESIZE
        ptr = CUdeviceptr()
        self._cu("cuMemAlloc_v2", ctypes.byref(ptr), size)
        one = ctypes.c_int(1)
        # GPUDirect RDMA wants synchronous memops on memory a NIC may touch.
        self._cu("cuPointerSetAttribute", ctypes.byref(one), CU_POINTER_ATTRIBUTE_SYNC_MEMOPS, ptr.value)
        return DeviceBuffer(device=device, address=int(ptr.value), size=size)

    def free(self, buffer: DeviceBuffer) -> None:
        self._use(buffer.device)
        self._cu("cuMemFree_v2", buffer.address)

    def copy_to_device(self, dst: DeviceBuffer, src: Any, *, offset: int = 0) -> None:
        with HostPointer(src, writable=False) as host:
            check_range(dst, offset, host.nbytes)
            self._use(dst.device)
            self._cu("cuMemcpyHtoD_v2", dst.address + offset, ctypes.c_void_p(host.address), host.nbytes)

    def copy_to_host(self, dst: Any, src: DeviceBuffer, *, offset: int = 0) -> None:
        with HostPointer(dst, writable=True) as host:
            check_range(src, offset, host.nbytes)
            self._use(src.device)
            self._cu("cuMemcpyDtoH_v2", ctypes.c_void_p(host.address), src.address + offset, host.nbytes)

    def copy_device(self, dst: DeviceBuffer, src: DeviceBuffer, size: int, *,
                    dst_offset: int = 0, src_offset: int = 0) -> None:
        check_range(dst, dst_offset, size)
        check_range(src, src_offset, size)
        if dst.device == src.device:
            self._use(dst.device)
            self._cu("cuMemcpyDtoD_v2", dst.address + dst_offset, src.address + src_offset, size)
        else:
            src_ctx = self._use(src.device)
            dst_ctx = self._use(dst.device)
            self._cu("cuMemcpyPeer", dst.address + dst_offset, ctypes.c_void_p(dst_ctx),
                     src.address + src_offset, ctypes.c_void_p(src_ctx), size)
        # Device-to-device copies are asynchronous to the host; the protocol promises completion.
        self._cu("cuCtxSynchronize")

    def ipc_handle(self, buffer: DeviceBuffer) -> bytes:
        handle = (ctypes.c_char * 64)()
        self._use(buffer.device)
        self._cu("cuIpcGetMemHandle", ctypes.byref(handle), buffer.address)
        return bytes(handle.raw)

    def open_ipc_handle(self, handle: bytes, *, device: int, size: int) -> DeviceBuffer:
        """Map another process's allocation into this one (cuIpcOpenMemHandle, peer access enabled lazily)."""
        if not self._cu.has("cuIpcOpenMemHandle_v2"):
            raise Unsupported(f"{CUDA_LIBRARY} (driver {self.driver_version}) lacks cuIpcOpenMemHandle_v2")
        if len(handle) != ctypes.sizeof(CUipcMemHandle):
            raise ValueError(f"handle: a CUDA IPC handle is 64 bytes, got {len(handle)}")
        raw = CUipcMemHandle()
        ctypes.memmove(ctypes.addressof(raw), handle, len(handle))
        pointer = CUdeviceptr()
        self._use(device)
        self._cu("cuIpcOpenMemHandle_v2", ctypes.byref(pointer), raw, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS)
        return DeviceBuffer(device=device, address=pointer.value, size=size, extra={"imported": True})

    def close_ipc_handle(self, buffer: DeviceBuffer) -> None:
        """Unmap a buffer from ``open_ipc_handle`` (the exporting process still owns the memory)."""
        self._use(buffer.device)
        self._cu("cuIpcCloseMemHandle", buffer.address)

    def register_host(self, address: int, size: int) -> None:
        """Page-lock ``size`` bytes at ``address`` for DMA (cuMemHostRegister, portable); once per range."""
        if not self._cu.has("cuMemHostRegister_v2"):
            raise Unsupported(f"{CUDA_LIBRARY} (driver {self.driver_version}) lacks cuMemHostRegister_v2")
        if size <= 0:
            raise ValueError(f"size: must be positive, got {size}")
        self._use(0)  # a current context; the portable flag pins for every device
        self._cu("cuMemHostRegister_v2", ctypes.c_void_p(address), size, CU_MEMHOSTREGISTER_PORTABLE)
        self.host_registrations += 1

    def unregister_host(self, address: int) -> None:
        if not self._cu.has("cuMemHostUnregister"):
            raise Unsupported(f"{CUDA_LIBRARY} (driver {self.driver_version}) lacks cuMemHostUnregister")
        self._use(0)
        self._cu("cuMemHostUnregister", ctypes.c_void_p(address))

    def export_dmabuf(self, buffer: DeviceBuffer) -> int:
        """A dma-buf fd for the whole buffer (caller closes it); Unsupported says exactly why not."""
        info = self._devices[buffer.device]
        if not self._cu.has("cuMemGetHandleForAddressRange"):
            raise Unsupported(f"{CUDA_LIBRARY} (driver {self.driver_version}) lacks cuMemGetHandleForAddressRange")
        if not info.dmabuf:
            raise Unsupported(f"CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED is 0 on device {buffer.device} "
                              f"({info.pci_bus_id})")
        self._use(buffer.device)
        fd = ctypes.c_int(-1)
        self._cu("cuMemGetHandleForAddressRange", ctypes.byref(fd), buffer.address, buffer.size,
                 CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD, 0)
        return fd.value

    def close(self) -> None:
        for device in list(self._contexts):
            try:
                self._cu("cuDevicePrimaryCtxRelease_v2", self._ordinals[device])
            except RuntimeCallError as exc:
                log.warning("runtime=nvidia step=cuDevicePrimaryCtxRelease device=%d error=%r", device, str(exc))
        self._contexts.clear()
        if self._nvml is not None:
            try:
                self._nvml.nvmlShutdown()
            except self._nvml.NVMLError:
                pass
            self._nvml = None


def describe(devices: Iterable[DeviceInfo]) -> list[str]:
    """One human line per device (used by the GPU check and ``daybreak topo``)."""
    return [f"device={d.index} bus_id={d.pci_bus_id} model={d.model!r} memory_bytes={d.memory_bytes} "
            f"dmabuf={'yes' if d.dmabuf else 'no'}" for d in devices]
