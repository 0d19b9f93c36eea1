"""Build the node's Topology: accelerators and NICs from sysfs, merged with what a loaded runtime reports.

Accelerators are PCI functions of class display (0x03xxxx) or processing
accelerator (0x12xxxx) from a known vendor, plus any function whose bus id a
runtime reports, so the topology is complete where no runtime loads and
exact where one does. GPU ids follow PCI bus order (like NVML's), NIC ids
the natural order of RDMA device names, so ids do not move when a runtime
comes or goes.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path

from daybreak.agent.runtime.base import DeviceInfo, PeerLink
from daybreak.agent.topology.model import (
    TopoDevice,
    Topology,
    classify,
    decide_gdr,
    natural_key,
    nic_ports,
    rank_nics,
    resolve_numa,
)
from daybreak.agent.topology.sysfs import PciFunction, SysfsSnapshot, parse_cpulist, snapshot

NVIDIA_VENDOR = 0x10DE
# ASSUMPTION: no public PCI vendor id for Sunrise parts was found (pci.ids has no entry);
# this placeholder is overridden by AgentSettings.sunrise_pci_vendors / DAYBREAK_SUNRISE_PCI_VENDORS.
DEFAULT_SUNRISE_VENDORS = (0x1F36,)
ACCELERATOR_CLASSES = (0x03, 0x12)  # display controller, processing accelerator
NIC_VENDORS = {0x15B3: "mellanox", 0x14E4: "broadcom", 0x8086: "intel", 0x1D0F: "amazon", 0x1DD8: "pensando",
               0x19E5: "huawei", 0x1077: "qlogic", 0x17D5: "neterion"}


def parse_vendor_ids(values: Iterable[str | int]) -> tuple[int, ...]:
    """``["0x1f36", 7990]`` -> (0x1f36, 7990); bad input names the field."""
    out = []
    for v in values:
        try:
            out.append(v if isinstance(v, int) else int(str(v).strip(), 0))
        except ValueError:
            raise ValueError(f"sunrise_pci_vendors: not a PCI vendor id: {v!r}") from None
    return tuple(out)


def _accelerator_vendor(fn: PciFunction, sunrise: Sequence[int]) -> str | None:
    if fn.pci_class >> 16 not in ACCELERATOR_CLASSES:
        return None
    if fn.vendor == NVIDIA_VENDOR:
        return "nvidia"
    if fn.vendor in sunrise:
        return "sunrise"
    return None


def _pci_device(fn: PciFunction, snap: SysfsSnapshot, *, id: str, kind: str) -> TopoDevice:
    cpus = parse_cpulist(fn.local_cpulist)
    return TopoDevice(
        id=id, kind="gpu" if kind == "gpu" else "nic", pci_bus_id=fn.bdf,
        numa_node=resolve_numa(fn, snap.numa_cpus, cpus), pcie_root=fn.root,
        cpu_affinity=fn.local_cpulist, sysfs_numa_node=fn.numa_node,
        link_speed=fn.current_link_speed or fn.max_link_speed, link_width=fn.current_link_width or fn.max_link_width,
        model=f"{fn.vendor:04x}:{fn.device:04x}", pci=fn,
    )


def build(snap: SysfsSnapshot, *, runtime: str = "host", runtime_devices: Sequence[DeviceInfo] = (),
          peer_links: Sequence[PeerLink] = (), sunrise_vendors: Sequence[int] = DEFAULT_SUNRISE_VENDORS,
          runtime_skipped: dict[str, str] | None = None) -> Topology:
    """The topology from one sysfs snapshot and (optionally) a runtime's devices and links."""
    by_bus = {d.pci_bus_id: d for d in runtime_devices}
    gpus: list[TopoDevice] = []
    matched: set[str] = set()
    for bdf in sorted(snap.pci):
        fn = snap.pci[bdf]
        vendor = _accelerator_vendor(fn, sunrise_vendors)
        info = by_bus.get(bdf)
        if vendor is None and info is None:
            continue
        dev = _pci_device(fn, snap, id="", kind="gpu")
        dev.vendor = info.vendor if info else vendor or ""
        if info is not None:
            matched.add(bdf)
            dev.memory_bytes, dev.model, dev.runtime_index, dev.dmabuf = (
                info.memory_bytes, info.model, info.index, info.dmabuf)
        gpus.append(dev)
    # A runtime device sysfs does not show (a container with a partial /sys): keep it, without a PCIe path.
    for info in sorted(runtime_devices, key=lambda d: d.pci_bus_id):
        if info.pci_bus_id not in matched:
            gpus.append(TopoDevice(id="", kind="gpu", pci_bus_id=info.pci_bus_id, numa_node=-1, vendor=info.vendor,
                                   model=info.model, memory_bytes=info.memory_bytes, runtime_index=info.index,
                                   dmabuf=info.dmabuf))
    for i, g in enumerate(gpus):
        g.id = f"GPU{i}"

    nics: list[TopoDevice] = []
    for ib in sorted(snap.rdma, key=lambda d: natural_key(d.name)):
        nic_fn = snap.pci.get(ib.bdf) if ib.bdf else None
        if nic_fn is not None:
            nic = _pci_device(nic_fn, snap, id=f"NIC{len(nics)}", kind="nic")
            nic.vendor = NIC_VENDORS.get(nic_fn.vendor, f"{nic_fn.vendor:04x}")
        else:
            nic = TopoDevice(id=f"NIC{len(nics)}", kind="nic", pci_bus_id=ib.bdf, numa_node=-1, model="software")
        nic.name, nic.ports, nic.netdevs = ib.name, nic_ports(ib), list(ib.netdevs)
        nics.append(nic)

    index_to_gpu = {g.runtime_index: g.id for g in gpus if g.runtime_index is not None}
    device_links = [(index_to_gpu[link.a], index_to_gpu[link.b], f"{link.kind}{link.links}")
                    for link in peer_links if link.a in index_to_gpu and link.b in index_to_gpu]
    devices = [*gpus, *nics]
    pairs, nic_pairs = classify(devices, device_links)
    links = {(p.a, p.b): p.link for p in pairs}
    nic_by_id = {n.id: n for n in nics}
    nic_rank, gdr = {}, {}
    for g in gpus:
        nic_rank[g.id] = rank_nics(g, nics, links)
        gdr[g.id] = decide_gdr(g, nic_rank[g.id], nic_by_id, links, snap.peer_memory)
    return Topology(runtime=runtime, devices=devices, pairs=pairs, nic_pairs=nic_pairs, nic_rank=nic_rank, gdr=gdr,
                    peer_memory=snap.peer_memory, numa_nodes=tuple(snap.numa_cpus),
                    runtime_skipped=dict(runtime_skipped or {}))


def discover(sysfs_root: Path | str, *, runtime: str = "host", runtime_devices: Sequence[DeviceInfo] = (),
             peer_links: Sequence[PeerLink] = (), sunrise_vendors: Sequence[int] = DEFAULT_SUNRISE_VENDORS,
             runtime_skipped: dict[str, str] | None = None) -> Topology:
    """Read sysfs under ``sysfs_root`` and build the topology (blocking file I/O: run it in a thread)."""
    return build(snapshot(sysfs_root), runtime=runtime, runtime_devices=runtime_devices, peer_links=peer_links,
                 sunrise_vendors=sunrise_vendors, runtime_skipped=runtime_skipped)
