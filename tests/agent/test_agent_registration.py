"""Memory registration: the pyverbs shim and the registrar against a fake of the pyverbs API surface
(both enum layouts), plus the real fallback on this machine (no pyverbs, no RDMA devices)."""

from __future__ import annotations

import ctypes
import enum
import importlib
import itertools
import os
import types
from collections.abc import Callable
from typing import Any

import pytest

from daybreak.agent.registration import Registrar, Segment, Verbs, host_segment
from daybreak.agent.runtime.base import DeviceBuffer, Unsupported
from daybreak.pool.shm import ShmSegment

_keys = itertools.count(0x1000)


class FakeError(Exception):
    """Stands in for PyverbsRDMAError."""


def fake_pyverbs(*, devices: list[str], new_enums: bool, dmabuf_takes_fd: bool = False,
                 fail_open: tuple[str, ...] = (), device_list_error: bool = False) -> tuple[
        Callable[[str], types.ModuleType], dict[str, Any]]:
    """An importer serving pyverbs.{device,pd,mr} and one enum module, recording what was registered."""
    state: dict[str, Any] = {"mrs": [], "closed": []}

    class Context:
        def __init__(self, *, name: str) -> None:
            if name in fail_open:
                raise FakeError(f"Failed to open device {name}")
            self.name = name

        def close(self) -> None:
            state["closed"].append(("ctx", self.name))

    class PD:
        def __init__(self, ctx: Context) -> None:
            self.ctx = ctx

        def close(self) -> None:
            state["closed"].append(("pd", self.ctx.name))

    class MR:
        def __init__(self, pd: PD, length: int, access: int, address: int | None = None) -> None:
            self.pd, self.length, self.access, self.address = pd, length, access, address
            self.lkey, self.rkey = next(_keys), next(_keys)
            state["mrs"].append(self)

        def close(self) -> None:
            state["closed"].append(("mr", self.lkey))

    class DmaBuf:
        """rdma-core's own DRM-allocated buffer type; DmaBufMR accepts nothing else in real pyverbs."""

    class DmaBufMR(MR):
        def __init__(self, pd: PD, length: int, access: int, dmabuf: Any = None, offset: int = 0) -> None:
            if not dmabuf_takes_fd and not isinstance(dmabuf, DmaBuf):
                raise TypeError("Argument 'dmabuf' has incorrect type (expected pyverbs.dmabuf.DmaBuf, got int)")
            super().__init__(pd, length, access)
            self.fd, self.offset = dmabuf, offset

    class Dev:
        def __init__(self, name: str) -> None:
            self.name = name.encode()

    def get_device_list() -> list[Dev]:
        if device_list_error:
            raise FakeError("Failed to get devices list")
        return [Dev(n) for n in devices]

    device = types.ModuleType("pyverbs.device")
    device.Context, device.get_device_list = Context, get_device_list  # type: ignore[attr-defined]
    pd = types.ModuleType("pyverbs.pd")
    pd.PD = PD  # type: ignore[attr-defined]
    mr = types.ModuleType("pyverbs.mr")
    mr.MR, mr.DmaBufMR = MR, DmaBufMR  # type: ignore[attr-defined]
    if new_enums:  # rdma-core v59+: cpdef enums exposed as classes
        enums = types.ModuleType("pyverbs.libibverbs_enums")

        class ibv_access_flags(enum.IntFlag):
            IBV_ACCESS_LOCAL_WRITE = 1
            IBV_ACCESS_REMOTE_WRITE = 2
            IBV_ACCESS_REMOTE_READ = 4

        enums.ibv_access_flags = ibv_access_flags  # type: ignore[attr-defined]
    else:  # Debian's rdma-core 44: module-level constants in pyverbs.enums
        enums = types.ModuleType("pyverbs.enums")
        enums.IBV_ACCESS_LOCAL_WRITE, enums.IBV_ACCESS_REMOTE_WRITE = 1, 2  # type: ignore[attr-defined]
        enums.IBV_ACCESS_REMOTE_READ = 4  # type: ignore[attr-defined]
    modules = {"pyverbs.device": device, "pyverbs.pd": pd, "pyverbs.mr": mr, enums.__name__: enums}

    def importer(name: str) -> types.ModuleType:
        if name not in modules:
            raise ModuleNotFoundError(f"No module named {name!r}")
        return modules[name]

    return importer, state


class FakeDmabufRuntime:
    """Only the part of the runtime registration uses: dma-buf export."""

    name = "fake"

    def __init__(self, supported: bool) -> None:
        self.supported = supported
        self.fds: list[int] = []

    def export_dmabuf(self, buffer: DeviceBuffer) -> int:
        if not self.supported:
            raise Unsupported("CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED is 0 on device 0")
        fd = os.open("/dev/null", os.O_RDONLY)
        self.fds.append(fd)
        return fd


@pytest.mark.parametrize("new_enums", [False, True], ids=["enums-v44", "libibverbs_enums-v59"])
def test_host_segment_registers_on_every_nic_and_deregisters(new_enums: bool) -> None:
    importer, state = fake_pyverbs(devices=["mlx5_0", "mlx5_1", "mlx5_9"], new_enums=new_enums)
    verbs = Verbs.load(importer)
    assert verbs.access == 7 and verbs.enum_module.endswith("libibverbs_enums" if new_enums else ".enums")
    seg = ShmSegment.create(f"daybreak-test-reg-{os.getpid()}-{int(new_enums)}", 1 << 20)
    try:
        reg = Registrar.open(["mlx5_0", "mlx5_1"], importer=importer)
        assert reg.rdma and reg.status == "rdma available" and reg.transports() == ["tcp"]
        host = host_segment("dram-0", seg.buffer)
        seg.buffer[:5] = b"hello"
        assert ctypes.string_at(host.address, 5) == b"hello" and host.length == seg.size
        regs = reg.register(host)
        assert [(r.nic, r.iova, r.length, r.method) for r in regs] == [
            ("mlx5_0", host.address, seg.size, "host"), ("mlx5_1", host.address, seg.size, "host")]
        assert regs[0].lkey != regs[1].lkey and all(r.rkey > 0 for r in regs)
        assert all(m.address == host.address and m.access == 7 for m in state["mrs"])
        assert reg.register(host) is regs  # idempotent by name
        assert reg.transports() == ["rdma", "tcp"]
        body = reg.to_json()
        assert body["nics"] == ["mlx5_0", "mlx5_1"] and len(body["registrations"]) == 2
        reg.close()
        closed = state["closed"]
        assert [c for c in closed if c[0] == "mr"] == [("mr", regs[0].lkey), ("mr", regs[1].lkey)]
        assert ("pd", "mlx5_0") in closed and ("ctx", "mlx5_1") in closed
        assert closed.index(("mr", regs[1].lkey)) < closed.index(("pd", "mlx5_0"))  # MRs before their PDs
        assert not reg.rdma and reg.registrations == {}
        seg.close()  # no buffer export is left behind by host_segment
    finally:
        seg.unlink()


def test_device_segment_dmabuf_then_peer_memory_then_reason() -> None:
    buffer = DeviceBuffer(device=0, address=0x7F00_0000_0000, size=1 << 21)
    device = Segment(name="hbm-0", address=buffer.address, length=buffer.size, kind="device", buffer=buffer)

    # newer pyverbs that takes the fd: a dma-buf MR whose IOVA is the offset (0), not the address
    importer, state = fake_pyverbs(devices=["mlx5_0"], new_enums=True, dmabuf_takes_fd=True)
    runtime = FakeDmabufRuntime(supported=True)
    reg = Registrar.open(["mlx5_0"], importer=importer)
    (r,) = reg.register(device, runtime=runtime)  # type: ignore[arg-type]
    assert (r.method, r.iova, r.length) == ("dmabuf", 0, 1 << 21)
    assert state["mrs"][0].fd == runtime.fds[0]
    with pytest.raises(OSError):
        os.fstat(runtime.fds[0])  # our copy of the fd was closed after registration

    # Debian's pyverbs (DmaBufMR wants its own DmaBuf): falls back to peer memory on the device address
    importer, state = fake_pyverbs(devices=["mlx5_0"], new_enums=False)
    reg = Registrar.open(["mlx5_0"], peer_memory=True, importer=importer)
    (r,) = reg.register(device, runtime=FakeDmabufRuntime(supported=True))  # type: ignore[arg-type]
    assert (r.method, r.iova) == ("peermem", buffer.address)

    # neither: nothing registered, and the reason names both paths
    reg = Registrar.open(["mlx5_0"], peer_memory=False, importer=importer)
    assert reg.register(device, runtime=FakeDmabufRuntime(supported=False)) == []  # type: ignore[arg-type]
    problem = reg.problems["hbm-0"]
    assert "dma-buf: CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED is 0" in problem and "peer memory" in problem
    assert reg.transports() == ["tcp"]


@pytest.mark.parametrize(("kwargs", "nics", "reason"), [
    ({"devices": ["mlx5_0"]}, [], "no RDMA device with an ACTIVE port"),
    ({"devices": [], "device_list_error": True}, ["mlx5_0"],
     "pyverbs get_device_list failed: Failed to get devices list"),
    ({"devices": []}, ["mlx5_0"], "pyverbs lists no RDMA devices"),
    ({"devices": ["mlx5_1"]}, ["mlx5_0"], "mlx5_0: not listed by pyverbs"),
    ({"devices": ["mlx5_0"], "fail_open": ("mlx5_0",)}, ["mlx5_0"], "mlx5_0: Failed to open device mlx5_0"),
])
def test_unavailable_reasons(kwargs: dict[str, Any], nics: list[str], reason: str) -> None:
    importer, _ = fake_pyverbs(new_enums=False, **kwargs)
    reg = Registrar.open(nics, importer=importer)
    assert not reg.rdma and reg.status == f"rdma unavailable: {reason}" and reg.transports() == ["tcp"]
    assert reg.register(Segment(name="dram", address=1, length=1)) == []
    assert reg.problems["dram"] == reg.status


def test_one_bad_nic_does_not_stop_the_others() -> None:
    importer, _ = fake_pyverbs(devices=["mlx5_0", "mlx5_1"], new_enums=True, fail_open=("mlx5_0",))
    reg = Registrar.open(["mlx5_0", "mlx5_1"], importer=importer)
    assert [n.name for n in reg.nics] == ["mlx5_1"]


def test_this_machine_reports_rdma_unavailable() -> None:
    """The real import path: no pyverbs (or no RDMA devices) here, so tcp only with the reason."""
    try:
        importlib.import_module("pyverbs.device")
        expected = "get_device_list failed"
    except ImportError:
        expected = "pyverbs not importable"
    reg = Registrar.open(["mlx5_0"])
    assert not reg.rdma and reg.status.startswith("rdma unavailable: ") and expected in reg.reason
    assert reg.transports() == ["tcp"]


def test_segment_validation_names_the_field() -> None:
    with pytest.raises(ValueError, match="length"):
        Segment(name="x", address=1, length=0)
    with pytest.raises(ValueError, match="buffer"):
        Segment(name="x", address=1, length=1, kind="device")
