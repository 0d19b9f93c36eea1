"""The topology rules on small hand-made cases: PCIe classes at the edges, NUMA resolution, runtime merging."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from daybreak.agent.runtime.base import DeviceInfo, PeerLink, normalize_bus_id
from daybreak.agent.topology import build, discover
from daybreak.agent.topology.model import gdr_capable, pcie_link, resolve_numa
from daybreak.agent.topology.sysfs import PciFunction, parse_cpulist, resolve, snapshot

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "sysfs"


def fn(bdf: str, root: str, *chain: str, numa: int = 0) -> PciFunction:
    return PciFunction(bdf=bdf, root=root, chain=tuple(chain), pci_class=0x030200, vendor=0x10DE, device=1,
                       numa_node=numa)


@pytest.mark.parametrize(("a", "b", "link"), [
    # two functions of one card on a root port: no switch crossed
    (fn("0000:21:00.0", "pci0000:20", "0000:20:01.0"), fn("0000:21:00.1", "pci0000:20", "0000:20:01.0"), "PIX"),
    # integrated devices on the root bus itself: only the host bridge joins them
    (fn("0000:00:02.0", "pci0000:00"), fn("0000:00:03.0", "pci0000:00"), "PHB"),
    # three switch levels on one side, one shared switch on top
    (fn("0000:09:00.0", "pci0000:00", "0000:00:01.0", "0000:01:00.0", "0000:02:00.0", "0000:03:00.0",
        "0000:04:00.0", "0000:05:00.0", "0000:06:00.0"),
     fn("0000:0a:00.0", "pci0000:00", "0000:00:01.0", "0000:01:00.0", "0000:02:01.0"), "PXB"),
    (fn("0000:03:00.0", "pci0000:00", "0000:00:01.0", numa=0), fn("0000:83:00.0", "pci0000:80", "0000:80:01.0",
                                                                   numa=0), "NODE"),
    (fn("0000:03:00.0", "pci0000:00", "0000:00:01.0", numa=0), fn("0000:83:00.0", "pci0000:80", "0000:80:01.0",
                                                                   numa=1), "SYS"),
    (fn("0000:03:00.0", "pci0000:00", "0000:00:01.0", numa=-1), fn("0000:83:00.0", "pci0000:80", "0000:80:01.0",
                                                                    numa=-1), "SYS"),
])
def test_pcie_link_edges(a: PciFunction, b: PciFunction, link: str) -> None:
    assert pcie_link(a, b, numa_a=a.numa_node, numa_b=b.numa_node) == link
    assert pcie_link(b, a, numa_a=b.numa_node, numa_b=a.numa_node) == link


def test_numa_resolution() -> None:
    two = {0: parse_cpulist("0-15"), 1: parse_cpulist("16-31")}
    assert resolve_numa(fn("x", "r", numa=1), two, frozenset()) == 1
    assert resolve_numa(fn("x", "r", numa=-1), two, parse_cpulist("16-31")) == 1
    assert resolve_numa(fn("x", "r", numa=-1), two, parse_cpulist("0-31")) == -1  # firmware does not know
    assert resolve_numa(fn("x", "r", numa=-1), two, frozenset()) == -1
    assert resolve_numa(fn("x", "r", numa=-1), {0: parse_cpulist("0-7")}, frozenset()) == 0  # one node: it
    assert resolve_numa(fn("x", "r", numa=-1), {}, frozenset()) == 0  # kernel without NUMA


def test_cpulist_and_bus_id_parsing() -> None:
    assert parse_cpulist("0-3,8,10-11\n") == {0, 1, 2, 3, 8, 10, 11}
    assert parse_cpulist("garbage") == frozenset()
    assert normalize_bus_id("00000000:3B:00.0") == "0000:3b:00.0"
    assert normalize_bus_id("3b:00.1") == "0000:3b:00.1"
    with pytest.raises(ValueError, match="pci_bus_id"):
        normalize_bus_id("not-a-bus")


def test_resolve_stays_inside_the_root(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "out").symlink_to("/etc")
    (tmp_path / "a" / "loop").symlink_to("loop")
    (tmp_path / "a" / "up").symlink_to("../../../../a")
    assert resolve(tmp_path, "a/out") is None
    assert resolve(tmp_path, "a/loop") is None
    assert resolve(tmp_path, "a/up") == ("a",)  # ".." stops at the root, as it does at "/"


def test_missing_files_are_neutral(tmp_path: Path) -> None:
    dev = tmp_path / "devices" / "pci0000:00" / "0000:00:01.0" / "0000:01:00.0"
    dev.mkdir(parents=True)
    (dev / "class").write_text("0x030200\n")
    (dev / "vendor").write_text("0x10de\n")
    (tmp_path / "bus" / "pci" / "devices").mkdir(parents=True)
    os.symlink("../../../devices/pci0000:00/0000:00:01.0/0000:01:00.0",
               tmp_path / "bus" / "pci" / "devices" / "0000:01:00.0")
    snap = snapshot(tmp_path)
    f = snap.pci["0000:01:00.0"]
    assert (f.numa_node, f.device, f.local_cpulist, f.chain) == (-1, 0, "", ("0000:00:01.0",))
    topo = build(snap)
    assert [g.pci_bus_id for g in topo.gpus] == ["0000:01:00.0"] and topo.nics == []


def test_runtime_merge_links_and_orphans() -> None:
    snap = snapshot(FIXTURES / "box4")
    runtime = [
        # runtime order differs from PCI order: ids still follow the bus
        DeviceInfo(index=0, pci_bus_id="0000:12:00.0", memory_bytes=64 << 30, vendor="sunrise", model="S2"),
        DeviceInfo(index=1, pci_bus_id="0000:03:00.0", memory_bytes=64 << 30, vendor="sunrise", model="S2"),
        # a device /sys does not show (partial /sys in a container): kept, without a PCIe path
        DeviceInfo(index=2, pci_bus_id="0000:99:00.0", memory_bytes=64 << 30, vendor="sunrise", model="S2"),
    ]
    topo = build(snap, runtime="sunrise", runtime_devices=runtime,
                 peer_links=[PeerLink(a=0, b=1, links=3, kind="SL"), PeerLink(a=1, b=2, links=1, kind="SL")])
    by_bus = {g.pci_bus_id: g for g in topo.gpus}
    assert [g.id for g in topo.gpus] == ["GPU0", "GPU1", "GPU2", "GPU3", "GPU4"]
    assert by_bus["0000:03:00.0"].runtime_index == 1 and by_bus["0000:12:00.0"].runtime_index == 0
    assert by_bus["0000:04:00.0"].runtime_index is None and by_bus["0000:04:00.0"].memory_bytes == 0
    orphan = by_bus["0000:99:00.0"]
    assert orphan.id == "GPU4" and orphan.pci is None
    links = {(p.a, p.b): p.link for p in topo.pairs}
    assert links[("GPU0", "GPU2")] == "SL3"  # 03:00.0 (index 1) <-> 12:00.0 (index 0)
    assert links[("GPU0", "GPU4")] == "SL1"
    assert links[("GPU1", "GPU4")] == "SYS" and links[("GPU4", "NIC0")] == "SYS"
    assert links[("GPU0", "GPU1")] == "PIX"


def test_gdr_needs_peer_memory_or_dmabuf() -> None:
    topo = discover(FIXTURES / "box4")
    gpu = topo.gpus[0]
    assert not gdr_capable(gpu, ())
    assert not gdr_capable(gpu, ("nv_mem",))  # an NVIDIA client does not serve Sunrise memory
    assert gdr_capable(gpu, ("sunrise_peer",))
    gpu.dmabuf = True
    assert gdr_capable(gpu, ())
    dmabuf = build(snapshot(FIXTURES / "box4"), runtime="sunrise", runtime_devices=[
        DeviceInfo(index=0, pci_bus_id="0000:03:00.0", memory_bytes=1, vendor="sunrise", model="S2", dmabuf=True)])
    assert dmabuf.gdr == {"GPU0": ["NIC0"], "GPU1": [], "GPU2": [], "GPU3": []}
