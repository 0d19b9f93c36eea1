"""Accelerator runtimes through their real loading paths: the gcc-built Sunrise libraries over ctypes,
NVML/libcuda on a machine without them, the fallback order, and ``daybreak topo`` merging Sunrise Links."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
from sunrise_lib.build import build, node

from daybreak.agent.runtime import RuntimeCallError, RuntimeUnavailable, Unsupported, load_runtime
from daybreak.agent.runtime.base import DeviceBuffer
from daybreak.agent.runtime.host import HostRuntime
from daybreak.agent.runtime.nvidia import NVLINK_DEVICE_TYPE_SWITCH, NvidiaRuntime, nvlink_peer_links
from daybreak.agent.runtime.sunrise import SunriseRuntime

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "sysfs"
DAYBREAK = str(Path(sys.executable).parent / "daybreak")
BOX4_BUSES = ["0000:12:00.0", "0000:13:00.0", "0000:03:00.0", "0000:04:00.0"]  # runtime order != PCI order
# Chips 0-1 (12:00.0-13:00.0) and 2-3 (03:00.0-04:00.0) with two ports each, 0-2 and 1-3 with one,
# and one link 1-2 that is down.
BOX4_LINKS = [[0, 0, 1, 0], [0, 1, 1, 1], [2, 0, 3, 0], [2, 1, 3, 1], [0, 2, 2, 2], [1, 2, 3, 2], [1, 3, 2, 3, 0]]


@pytest.fixture(scope="module")
def libdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build(tmp_path_factory.mktemp("sunrise-lib"))


@pytest.fixture
def fake_node(monkeypatch: pytest.MonkeyPatch) -> Iterator[pytest.MonkeyPatch]:
    monkeypatch.setenv("DAYBREAK_FAKE_SUNRISE", node(BOX4_BUSES, links=BOX4_LINKS, memory_bytes=1 << 20))
    monkeypatch.delenv("DAYBREAK_FAKE_SUNRISE_FAIL", raising=False)
    yield monkeypatch


def test_sunrise_enumerates_devices_and_links(libdir: Path, fake_node: pytest.MonkeyPatch) -> None:
    rt = SunriseRuntime.load(lib_dir=str(libdir))
    devs = rt.devices()
    assert [d.pci_bus_id for d in devs] == BOX4_BUSES
    assert {(d.vendor, d.model, d.memory_bytes) for d in devs} == {("sunrise", "Sunrise S2", 1 << 20)}
    assert [d.uuid for d in devs] == ["SR-0000", "SR-0001", "SR-0002", "SR-0003"]
    assert [(link.a, link.b, link.links, link.kind) for link in rt.peer_links()] == [
        (0, 1, 2, "SL"), (0, 2, 1, "SL"), (1, 3, 1, "SL"), (2, 3, 2, "SL")]


def test_sunrise_copies_host_device_and_peer(libdir: Path, fake_node: pytest.MonkeyPatch) -> None:
    rt = SunriseRuntime.load(lib_dir=str(libdir))
    payload = os.urandom(64 << 10)
    a, b = rt.allocate(0, len(payload)), rt.allocate(2, len(payload))
    try:
        rt.copy_to_device(a, payload)
        assert rt.pointer_device(a.address) == 0 and rt.pointer_device(b.address) == 2
        rt.copy_device(b, a, len(payload))  # peer copy (tangMemcpyPeer)
        out = bytearray(len(payload))
        rt.copy_to_host(out, b)
        assert bytes(out) == payload
        rt.copy_device(a, b, 1000, dst_offset=5, src_offset=100)  # same-device path on the way back
        part = bytearray(1000)
        rt.copy_to_host(part, a, offset=5)
        assert bytes(part) == payload[100:1100]
        with pytest.raises(ValueError, match="offset"):
            rt.copy_to_host(bytearray(10), a, offset=len(payload) - 5)
        with pytest.raises(TypeError, match="read-only"):
            rt.copy_to_host(b"immutable", a)
        assert rt.pointer_device(id(payload)) is None  # host memory
    finally:
        rt.free(a)
        rt.free(b)


def test_sunrise_errors_surface_with_names(libdir: Path, fake_node: pytest.MonkeyPatch) -> None:
    rt = SunriseRuntime.load(lib_dir=str(libdir))
    with pytest.raises(RuntimeCallError, match=r"tangMalloc failed: 2 \(out of memory\)"):
        rt.allocate(1, 2 << 20)  # more than the 1 MiB the device has
    fake_node.setenv("DAYBREAK_FAKE_SUNRISE_FAIL", "tangMemcpyPeer=217")
    a, b = rt.allocate(0, 4096), rt.allocate(1, 4096)
    try:
        with pytest.raises(RuntimeCallError, match="peer access is not supported") as err:
            rt.copy_device(b, a, 4096)
        assert err.value.code == 217 and err.value.function == "tangMemcpyPeer"
    finally:
        fake_node.delenv("DAYBREAK_FAKE_SUNRISE_FAIL")
        rt.free(a)
        rt.free(b)
    with pytest.raises(RuntimeCallError, match="invalid device pointer"):
        rt.free(DeviceBuffer(device=0, address=12345, size=1))
    with pytest.raises(Unsupported):
        rt.export_dmabuf(DeviceBuffer(device=0, address=0, size=1))


def test_sunrise_ipc_handle_opens_in_another_process(libdir: Path, fake_node: pytest.MonkeyPatch) -> None:
    rt = SunriseRuntime.load(lib_dir=str(libdir))
    buf = rt.allocate(3, 8192)
    try:
        rt.copy_to_device(buf, b"written by the parent" + bytes(100))
        handle = rt.ipc_handle(buf)
        child = textwrap.dedent(f"""
            from daybreak.agent.runtime.sunrise import SunriseRuntime
            rt = SunriseRuntime.load(lib_dir={str(libdir)!r})
            peer = rt.open_ipc_handle(bytes.fromhex({handle.hex()!r}), device=3, size=8192)
            out = bytearray(21)
            rt.copy_to_host(out, peer)
            rt.copy_to_device(peer, b"and the child answers")
            rt.close_ipc_handle(peer)
            print(out.decode())
        """)
        proc = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=60,
                              env={**os.environ, "PYTHONSAFEPATH": "1"}, cwd="/")
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.strip() == "written by the parent"
        back = bytearray(21)
        rt.copy_to_host(back, buf)
        assert back == b"and the child answers"
    finally:
        rt.free(buf)


@pytest.mark.parametrize(("env", "reason"), [
    ({"DAYBREAK_FAKE_SUNRISE": None}, r"ptmlInit returned 6 \(PTML_ERROR_DRIVER_NOT_LOADED"),
    ({"DAYBREAK_FAKE_SUNRISE_FAIL": "ptmlInit=9"}, r"ptmlInit returned 9 \(PTML_ERROR_UNKNOWN"),
    ({"DAYBREAK_FAKE_SUNRISE_FAIL": "tangGetDeviceCount=3"}, r"tangGetDeviceCount returned 3 \(initialization error"),
    ({"DAYBREAK_FAKE_SUNRISE": node([])}, "zero devices"),
    ({"DAYBREAK_FAKE_SUNRISE_FAIL": "tangDeviceGetPCIBusId=101"}, "invalid device ordinal"),
])
def test_sunrise_failures_fall_back_to_host(libdir: Path, fake_node: pytest.MonkeyPatch, env: dict[str, str | None],
                                             reason: str, caplog: pytest.LogCaptureFixture) -> None:
    for key, value in env.items():
        if value is None:
            fake_node.delenv(key, raising=False)
        else:
            fake_node.setenv(key, value)
    with pytest.raises(RuntimeUnavailable, match=reason):
        SunriseRuntime.load(lib_dir=str(libdir))
    caplog.set_level(logging.INFO, logger="daybreak.agent.runtime.loader")
    loaded = load_runtime("sunrise", sunrise_lib_dir=str(libdir))
    assert loaded.name == "host" and isinstance(loaded.runtime, HostRuntime)
    lines = [r.getMessage() for r in caplog.records if "runtime=sunrise" in r.getMessage()]
    assert len(lines) == 1 and "status=unavailable" in lines[0]


def test_phytopo_failure_only_loses_links(libdir: Path, fake_node: pytest.MonkeyPatch) -> None:
    fake_node.setenv("DAYBREAK_FAKE_SUNRISE_FAIL", "ptmlPtlinkPhytopoDetect=7,ptmlPtlinkEnableAll=5")
    rt = SunriseRuntime.load(lib_dir=str(libdir))
    assert len(rt.devices()) == 4 and rt.peer_links() == ()


def test_missing_library_and_env_var_directory(tmp_path: Path, libdir: Path, fake_node: pytest.MonkeyPatch) -> None:
    with pytest.raises(RuntimeUnavailable, match=r"cannot load libptml_shared\.so"):
        SunriseRuntime.load(lib_dir=str(tmp_path))
    fake_node.setenv("DAYBREAK_SUNRISE_LIB_DIR", str(libdir))
    assert len(SunriseRuntime.load().devices()) == 4  # the directory from the environment variable


def test_auto_order_prefers_sunrise_then_falls_back(libdir: Path, fake_node: pytest.MonkeyPatch) -> None:
    assert load_runtime("auto", sunrise_lib_dir=str(libdir)).name == "sunrise"
    fake_node.delenv("DAYBREAK_FAKE_SUNRISE")
    loaded = load_runtime("auto", sunrise_lib_dir=str(libdir))
    assert loaded.name == "host" and set(loaded.skipped) == {"sunrise", "nvidia"}
    with pytest.raises(ValueError, match="runtime"):
        load_runtime("cuda")


def test_nvidia_without_a_driver_is_unavailable_not_fatal() -> None:
    """This machine has nvidia-ml-py (test extra) but no NVIDIA driver: nvmlInit fails and we fall back."""
    with pytest.raises(RuntimeUnavailable) as err:
        NvidiaRuntime.load()
    assert err.value.runtime == "nvidia" and "nvmlInit failed" in err.value.reason
    loaded = load_runtime("nvidia")
    assert loaded.name == "host" and "nvmlInit failed" in loaded.skipped["nvidia"]


def test_nvidia_module_imports_without_pynvml_or_pydantic() -> None:
    code = textwrap.dedent("""
        import sys
        class Block:
            def find_spec(self, name, path=None, target=None):
                if name.split('.')[0] in ('pynvml', 'pydantic', 'kubernetes', 'kubernetes_asyncio', 'kopf'):
                    raise ImportError('blocked: ' + name)
        sys.meta_path.insert(0, Block())
        from daybreak.agent.runtime.nvidia import NvidiaRuntime
        from daybreak.agent.runtime import RuntimeUnavailable
        try:
            NvidiaRuntime.load()
        except RuntimeUnavailable as exc:
            print(exc.reason)
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd="/")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("nvidia-ml-py not installed")


def test_nvlink_bundles_direct_and_through_switches() -> None:
    gpus = {f"0000:{i:02x}:00.0": i for i in range(4)}
    ports = {
        # GPU0 <-> GPU1 four links seen from both ends; GPU2 and GPU3 hang off NVSwitches (6 and 4 links)
        "0000:00:00.0": [("0000:01:00.0", 0)] * 4,
        "0000:01:00.0": [("0000:00:00.0", 0)] * 4,
        "0000:02:00.0": [("0000:c0:00.0", NVLINK_DEVICE_TYPE_SWITCH)] * 6,
        "0000:03:00.0": [("0000:c1:00.0", NVLINK_DEVICE_TYPE_SWITCH)] * 4,
    }
    assert [(p.a, p.b, p.links, p.kind) for p in nvlink_peer_links(ports, gpus)] == [(0, 1, 4, "NV"), (2, 3, 4, "NV")]


def test_host_runtime_refuses_device_work() -> None:
    rt = HostRuntime()
    assert rt.devices() == () and rt.peer_links() == ()
    with pytest.raises(Unsupported):
        rt.allocate(0, 1)


def test_topo_merges_sunrise_links_on_the_box4_fixture(libdir: Path) -> None:
    env = {**os.environ, "DAYBREAK_FAKE_SUNRISE": node(BOX4_BUSES, links=BOX4_LINKS, memory_bytes=64 << 30),
           "DAYBREAK_SUNRISE_LIB_DIR": str(libdir)}
    proc = subprocess.run([DAYBREAK, "topo", "--sysfs-root", str(FIXTURES / "box4"), "--json"], capture_output=True,
                          text=True, timeout=60, env=env)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["runtime"] == "sunrise"
    # GPU ids follow the bus: GPU0 03:00.0 (chip 2), GPU1 04:00.0 (chip 3), GPU2 12:00.0 (chip 0), GPU3 13:00.0 (chip 1)
    assert {d["id"]: d["runtime_index"] for d in out["devices"] if d["kind"] == "gpu"} == {
        "GPU0": 2, "GPU1": 3, "GPU2": 0, "GPU3": 1}
    links = {(p["a"], p["b"]): p["link"] for p in out["pairs"]}
    assert links == {("GPU0", "GPU1"): "SL2", ("GPU0", "GPU2"): "SL1", ("GPU0", "GPU3"): "PHB",
                     ("GPU0", "NIC0"): "PIX", ("GPU1", "GPU2"): "PHB", ("GPU1", "GPU3"): "SL1",
                     ("GPU1", "NIC0"): "PIX", ("GPU2", "GPU3"): "SL2", ("GPU2", "NIC0"): "PHB",
                     ("GPU3", "NIC0"): "PHB"}
    assert {d["memory_bytes"] for d in out["devices"] if d["kind"] == "gpu"} == {64 << 30}
    text = subprocess.run([DAYBREAK, "topo", "--sysfs-root", str(FIXTURES / "box4")], capture_output=True,
                          text=True, timeout=60, env=env).stdout
    assert "GPU0  X     SL2   SL1   PHB   PIX" in text
