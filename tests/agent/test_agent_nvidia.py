"""The nvidia runtime's CUDA driver path through ctypes, against a gcc-built stand-in for libcuda.so.1
(host memory, per-thread current context, dma-buf as a memfd) and a stand-in NVML module (the selfcheck's
no-GPU path is in test_selfcheck.py). The real driver path ran on the lent H200 (docs/hardware.md)."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import textwrap
import threading
import types
from pathlib import Path
from typing import Any

import pytest

from daybreak.agent.runtime import RuntimeCallError, RuntimeUnavailable, Unsupported
from daybreak.agent.runtime.nvidia import NvidiaRuntime

FAKE_CUDA = r"""
#define _GNU_SOURCE
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

typedef unsigned long long CUdeviceptr;
static __thread void *current;           /* the calling thread's current context */
static int initialized;
static char ctx_token[4];                 /* one "context" object per device */
static const char *buses[] = {"0000:3B:00.0", "0000:86:00.0"};

static int count(void) { const char *e = getenv("FAKE_CUDA_DEVICES"); return e ? atoi(e) : 2; }
#define NEED_INIT if (!initialized) return 3       /* CUDA_ERROR_NOT_INITIALIZED */
#define NEED_CTX if (!current) return 201          /* CUDA_ERROR_INVALID_CONTEXT */

int cuGetErrorName(int e, const char **s) {
    *s = e == 0 ? "CUDA_SUCCESS" : e == 3 ? "CUDA_ERROR_NOT_INITIALIZED" : e == 100 ? "CUDA_ERROR_NO_DEVICE"
       : e == 201 ? "CUDA_ERROR_INVALID_CONTEXT" : e == 2 ? "CUDA_ERROR_OUT_OF_MEMORY" : "CUDA_ERROR_UNKNOWN";
    return 0;
}
int cuInit(unsigned f) { (void)f; if (count() == 0) return 100; initialized = 1; return 0; }
int cuDriverGetVersion(int *v) { *v = 12040; return 0; }
int cuDeviceGetCount(int *n) { NEED_INIT; *n = count(); return 0; }
int cuDeviceGet(int *d, int i) { NEED_INIT; if (i >= count()) return 101; *d = i; return 0; }
int cuDeviceGetPCIBusId(char *b, int n, int d) { snprintf(b, n, "%s", buses[d]); return 0; }
int cuDeviceGetAttribute(int *v, int attr, int d) {
    (void)d; *v = attr == 124 ? (getenv("FAKE_CUDA_NO_DMABUF") ? 0 : 1) : 0; return 0;
}
int cuDeviceTotalMem_v2(size_t *m, int d) { (void)d; *m = (size_t)80 << 30; return 0; }
int cuDeviceGetName(char *b, int n, int d) { (void)d; snprintf(b, n, "Fake H200"); return 0; }
int cuDevicePrimaryCtxRetain(void **c, int d) { NEED_INIT; *c = &ctx_token[d]; return 0; }
int cuDevicePrimaryCtxRelease_v2(int d) { (void)d; return 0; }
int cuCtxSetCurrent(void *c) { current = c; return 0; }
int cuCtxSynchronize(void) { NEED_CTX; return 0; }
/* "Device memory" is a shared memfd mapping, so an IPC handle (pid, fd) opens in another process. */
typedef struct { CUdeviceptr base; size_t size; int fd; } alloc_t;
static alloc_t allocs[256];
typedef struct { char reserved[64]; } CUipcMemHandle;
typedef struct { unsigned magic; int pid, fd; unsigned long long size, offset; } ipc_payload;
#define IPC_MAGIC 0x44425543u
int cuMemAlloc_v2(CUdeviceptr *p, size_t n) {
    NEED_CTX;
    int slot = 0;
    while (slot < 256 && allocs[slot].base) slot++;
    if (slot == 256) return 2;
    int fd = memfd_create("fake-cuda", MFD_CLOEXEC);
    if (fd < 0 || ftruncate(fd, (off_t)n)) return 2;
    void *m = mmap(NULL, n, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (m == MAP_FAILED) { close(fd); return 2; }
    allocs[slot] = (alloc_t){(CUdeviceptr)(uintptr_t)m, n, fd};
    *p = allocs[slot].base; return 0;
}
int cuMemFree_v2(CUdeviceptr p) {
    NEED_CTX;
    for (int i = 0; i < 256; i++)
        if (allocs[i].base == p) { munmap((void *)(uintptr_t)p, allocs[i].size); close(allocs[i].fd); allocs[i].base = 0; }
    return 0;
}
int cuMemcpyHtoD_v2(CUdeviceptr d, const void *s, size_t n) { NEED_CTX; memcpy((void *)(uintptr_t)d, s, n); return 0; }
int cuMemcpyDtoH_v2(void *d, CUdeviceptr s, size_t n) { NEED_CTX; memcpy(d, (void *)(uintptr_t)s, n); return 0; }
int cuMemcpyDtoD_v2(CUdeviceptr d, CUdeviceptr s, size_t n) {
    NEED_CTX; memmove((void *)(uintptr_t)d, (void *)(uintptr_t)s, n); return 0;
}
int cuMemcpyPeer(CUdeviceptr d, void *dc, CUdeviceptr s, void *sc, size_t n) {
    if (!dc || !sc || dc == sc) return 1;
    memmove((void *)(uintptr_t)d, (void *)(uintptr_t)s, n); return 0;
}
int cuIpcGetMemHandle(void *h, CUdeviceptr p) {
    NEED_CTX;
    for (int i = 0; i < 256; i++) {
        alloc_t *a = &allocs[i];
        if (a->base && a->base <= p && p < a->base + a->size) {
            ipc_payload pl = {IPC_MAGIC, (int)getpid(), a->fd, a->size, p - a->base};
            memset(h, 0, 64); memcpy(h, &pl, sizeof pl); return 0;
        }
    }
    return 1;  /* CUDA_ERROR_INVALID_VALUE */
}
int cuIpcOpenMemHandle_v2(CUdeviceptr *p, CUipcMemHandle h, unsigned flags) {
    NEED_CTX;
    ipc_payload pl; char path[64];
    memcpy(&pl, h.reserved, sizeof pl);
    if (pl.magic != IPC_MAGIC || flags != 1) return 1;
    if (pl.pid == (int)getpid()) return 1;  /* like CUDA: a process cannot open its own handle */
    snprintf(path, sizeof path, "/proc/%d/fd/%d", pl.pid, pl.fd);
    int fd = open(path, O_RDWR | O_CLOEXEC);
    if (fd < 0) return 1;
    void *m = mmap(NULL, pl.size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (m == MAP_FAILED) return 2;
    *p = (CUdeviceptr)(uintptr_t)m + pl.offset; return 0;
}
int cuIpcCloseMemHandle(CUdeviceptr p) { NEED_CTX; (void)p; return 0; }
int cuPointerSetAttribute(const void *v, int attr, CUdeviceptr p) {
    NEED_CTX; (void)p; return (attr == 6 && *(const int *)v == 1) ? 0 : 1;
}
int cuMemGetHandleForAddressRange(void *h, CUdeviceptr p, size_t n, int type, unsigned long long flags) {
    NEED_CTX; (void)p; (void)flags;
    if (type != 1 || n % (size_t)sysconf(_SC_PAGESIZE)) return 1;
    int fd = memfd_create("dmabuf", MFD_CLOEXEC);
    if (fd < 0 || ftruncate(fd, (off_t)n)) return 999;
    *(int *)h = fd; return 0;
}
"""


class NVMLError(Exception):
    pass


def fake_nvml(memory: int = 141 << 30) -> types.ModuleType:
    """The pynvml calls the runtime makes; NVLink reports NotSupported like a PCIe-only card."""
    m = types.ModuleType("pynvml")
    handles = ["h0", "h1"]
    m.NVMLError = NVMLError  # type: ignore[attr-defined]
    m.nvmlInit = lambda: None  # type: ignore[attr-defined]
    m.nvmlShutdown = lambda: None  # type: ignore[attr-defined]
    m.nvmlDeviceGetCount = lambda: 2  # type: ignore[attr-defined]
    m.nvmlDeviceGetHandleByIndex = lambda i: handles[i]  # type: ignore[attr-defined]
    m.nvmlDeviceGetPciInfo = lambda h: types.SimpleNamespace(  # type: ignore[attr-defined]
        busId=b"00000000:3B:00.0" if h == "h0" else "00000000:86:00.0")
    m.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(total=memory)  # type: ignore[attr-defined]
    m.nvmlDeviceGetName = lambda h: "NVIDIA H200"  # type: ignore[attr-defined]
    m.nvmlDeviceGetUUID = lambda h: f"GPU-{h}"  # type: ignore[attr-defined]

    def nvlink_state(h: Any, link: int) -> int:
        raise NVMLError("Not Supported")

    m.nvmlDeviceGetNvLinkState = nvlink_state  # type: ignore[attr-defined]
    return m


@pytest.fixture(scope="module")
def libcuda(tmp_path_factory: pytest.TempPathFactory) -> str:
    gcc = shutil.which("gcc")
    assert gcc, "gcc is needed to build the libcuda stand-in"
    out = tmp_path_factory.mktemp("fake-cuda")
    (out / "fake_cuda.c").write_text(FAKE_CUDA)
    subprocess.run([gcc, "-shared", "-fPIC", "-O1", "-Wall", "-Werror", "-o", str(out / "libcuda.so.1"),
                    str(out / "fake_cuda.c")], check=True, capture_output=True, text=True)
    return str(out / "libcuda.so.1")


def test_enumeration_joins_nvml_on_the_bus_id(libcuda: str) -> None:
    rt = NvidiaRuntime.load(nvml_module=fake_nvml(), cuda_library=libcuda)
    assert [(d.index, d.pci_bus_id, d.memory_bytes, d.model, d.uuid, d.dmabuf) for d in rt.devices()] == [
        (0, "0000:3b:00.0", 141 << 30, "NVIDIA H200", "GPU-h0", True),
        (1, "0000:86:00.0", 141 << 30, "NVIDIA H200", "GPU-h1", True)]
    assert rt.peer_links() == () and rt.driver_version == 12040
    rt.close()


def test_memory_copies_ipc_and_dmabuf(libcuda: str) -> None:
    rt = NvidiaRuntime.load(nvml_module=fake_nvml(), cuda_library=libcuda)
    data = os.urandom(10_000)
    a = rt.allocate(0, len(data))
    assert a.size == 12288  # rounded up to whole pages, so the buffer can be a dma-buf
    b, c = rt.allocate(0, a.size), rt.allocate(1, a.size)
    rt.copy_to_device(a, data)
    rt.copy_device(b, a, len(data))  # same device: cuMemcpyDtoD
    rt.copy_device(c, b, len(data))  # across devices: cuMemcpyPeer with both contexts
    out = bytearray(len(data))
    # from another thread: the runtime must make the context current there too
    worker = threading.Thread(target=rt.copy_to_host, args=(out, c))
    worker.start()
    worker.join()
    assert bytes(out) == data
    assert len(rt.ipc_handle(a)) == 64
    fd = rt.export_dmabuf(a)
    try:
        assert os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:dmabuf") and os.fstat(fd).st_size == a.size
    finally:
        os.close(fd)
    for buf in (a, b, c):
        rt.free(buf)
    rt.close()


def test_ipc_handle_opens_in_another_process_both_ways(libcuda: str) -> None:
    """The link transport's cross-process path: the exporter's device bytes seen and written by an importer."""
    child = textwrap.dedent(f"""
        import hashlib, sys
        sys.path[:0] = [{str(Path(__file__).parent)!r}, {str(Path(__file__).resolve().parents[1])!r}]  # + tests/
        from test_agent_nvidia import fake_nvml
        from daybreak.agent.runtime.nvidia import NvidiaRuntime
        rt = NvidiaRuntime.load(nvml_module=fake_nvml(), cuda_library={libcuda!r})
        buf = rt.allocate(0, 1 << 20)
        rt.copy_to_device(buf, bytes(range(256)) * 4096)
        print(rt.ipc_handle(buf).hex(), flush=True)
        sys.stdin.readline()  # the importer has written its half
        out = bytearray(1 << 20)
        rt.copy_to_host(out, buf)
        print(hashlib.sha256(out).hexdigest(), flush=True)
    """)
    proc = subprocess.Popen([sys.executable, "-c", child], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd="/")
    assert proc.stdin is not None and proc.stdout is not None
    try:
        handle = bytes.fromhex(proc.stdout.readline().strip())
        rt = NvidiaRuntime.load(nvml_module=fake_nvml(), cuda_library=libcuda)
        with pytest.raises(ValueError, match="64 bytes"):
            rt.open_ipc_handle(handle[:10], device=0, size=1 << 20)
        remote = rt.open_ipc_handle(handle, device=0, size=1 << 20)
        seen = bytearray(1 << 20)
        rt.copy_to_host(seen, remote)
        assert bytes(seen) == bytes(range(256)) * 4096
        rt.copy_to_device(remote, b"\xee" * 4096, offset=4096)
        rt.close_ipc_handle(remote)
        rt.close()
        proc.stdin.write("\n")
        proc.stdin.flush()
        expected = bytearray(bytes(range(256)) * 4096)
        expected[4096:8192] = b"\xee" * 4096
        assert proc.stdout.readline().strip() == hashlib.sha256(expected).hexdigest()
    finally:
        proc.kill()
        proc.wait()


def test_dmabuf_unsupported_and_errors_are_exact(libcuda: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_CUDA_NO_DMABUF", "1")
    rt = NvidiaRuntime.load(nvml_module=fake_nvml(), cuda_library=libcuda)
    buf = rt.allocate(0, 4096)
    with pytest.raises(Unsupported, match=r"CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED is 0 on device 0 \(0000:3b:00.0\)"):
        rt.export_dmabuf(buf)
    with pytest.raises(ValueError, match="device"):
        rt.allocate(5, 4096)
    with pytest.raises(ValueError, match="offset"):
        rt.copy_to_device(buf, bytes(8192))
    rt.free(buf)
    rt.close()
    monkeypatch.setenv("FAKE_CUDA_DEVICES", "0")
    with pytest.raises(RuntimeUnavailable, match="cuInit failed: 100 \\(CUDA_ERROR_NO_DEVICE\\)"):
        NvidiaRuntime.load(nvml_module=fake_nvml(), cuda_library=libcuda)


def test_missing_libcuda_is_unavailable(tmp_path: Path) -> None:
    with pytest.raises(RuntimeUnavailable, match="cannot load"):
        NvidiaRuntime.load(nvml_module=fake_nvml(), cuda_library=str(tmp_path / "libcuda.so.1"))


def test_call_error_carries_the_cuda_name(libcuda: str) -> None:
    rt = NvidiaRuntime.load(nvml_module=fake_nvml(), cuda_library=libcuda)
    with pytest.raises(RuntimeCallError, match="CUDA_ERROR_INVALID_CONTEXT") as err:
        rt._cu("cuCtxSetCurrent", None)
        rt._cu("cuMemAlloc_v2", None, 1)
    assert err.value.code == 201
    rt.close()
