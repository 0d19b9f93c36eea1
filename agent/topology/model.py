"""The node topology model and its rules: link classes, NIC ranking per accelerator, GDR per pair (no I/O).

Link classes follow ``nvidia-smi topo -m`` (see docs/hardware.md): a direct
device link wins (``SL<n>`` Sunrise Link ports, ``NV<n>`` NVLinks); else the
PCIe path decides. Under one root port the bridges below the root port come
in pairs (a switch's upstream port, then one of its downstream ports), so a
bridge at depth i >= 1 belongs to switch level (i + 1) // 2; crossing at most
one switch is ``PIX``, more is ``PXB``; different root ports of one root
complex is ``PHB``; different root complexes on one NUMA node ``NODE``; any
other case, including an unknown NUMA node, ``SYS``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from daybreak.agent.topology.sysfs import IbDevice, PciFunction

LINK_ORDER = ("PIX", "PXB", "PHB", "NODE", "SYS")
GDR_LINKS = ("PIX", "PXB")  # NCCL's default GDR level: no worse than PXB
DeviceKind = Literal["gpu", "nic"]

LEGEND = (
    ("X", "the device itself"),
    ("SYS", "PCIe plus the interconnect between NUMA nodes (QPI/UPI/Infinity Fabric)"),
    ("NODE", "PCIe plus the link between PCIe host bridges of one NUMA node"),
    ("PHB", "PCIe through a host bridge (the CPU's root complex)"),
    ("PXB", "PCIe through several PCIe switches, not through a host bridge"),
    ("PIX", "PCIe through at most one PCIe switch"),
    ("NV#", "a bonded set of # NVLinks"),
    ("SL#", "a bonded set of # Sunrise Link ports"),
)


@dataclass
class TopoDevice:
    """A GPU (any accelerator) or an RDMA NIC, with what the runtime added where one loaded."""

    id: str  # "GPU0", "NIC3"
    kind: DeviceKind
    pci_bus_id: str | None
    numa_node: int  # resolved; -1 when unknown
    pcie_root: str | None = None
    vendor: str = ""
    model: str = ""
    name: str = ""  # NIC: the RDMA device name (mlx5_0)
    memory_bytes: int = 0
    runtime_index: int | None = None
    dmabuf: bool = False
    cpu_affinity: str = ""
    sysfs_numa_node: int = -1
    link_speed: str = ""
    link_width: str = ""
    ports: list[dict[str, Any]] = field(default_factory=list)
    netdevs: list[str] = field(default_factory=list)
    pci: PciFunction | None = field(default=None, repr=False)

    @property
    def active(self) -> bool:
        return any(p.get("state") == "ACTIVE" for p in self.ports)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"id": self.id, "kind": self.kind, "pci_bus_id": self.pci_bus_id,
                               "numa_node": self.numa_node, "pcie_root": self.pcie_root, "vendor": self.vendor,
                               "model": self.model, "cpu_affinity": self.cpu_affinity,
                               "sysfs_numa_node": self.sysfs_numa_node,
                               "link_speed": self.link_speed, "link_width": self.link_width}
        if self.kind == "gpu":
            out.update(memory_bytes=self.memory_bytes, runtime_index=self.runtime_index, dmabuf=self.dmabuf)
        else:
            out.update(name=self.name, active=self.active, ports=self.ports, netdevs=self.netdevs)
        return out


@dataclass(frozen=True)
class Pair:
    a: str
    b: str
    link: str


@dataclass
class Topology:
    """The whole node: devices, every GPU-GPU and GPU-NIC link class, NIC ranking and GDR decisions."""

    runtime: str
    devices: list[TopoDevice]
    pairs: list[Pair]
    nic_pairs: list[Pair]
    nic_rank: dict[str, list[str]]
    gdr: dict[str, list[str]]
    peer_memory: tuple[str, ...] = ()
    numa_nodes: tuple[int, ...] = ()
    runtime_skipped: dict[str, str] = field(default_factory=dict)

    @property
    def gpus(self) -> list[TopoDevice]:
        return [d for d in self.devices if d.kind == "gpu"]

    @property
    def nics(self) -> list[TopoDevice]:
        return [d for d in self.devices if d.kind == "nic"]

    def link(self, a: str, b: str) -> str:
        if a == b:
            return "X"
        for p in (*self.pairs, *self.nic_pairs):
            if {p.a, p.b} == {a, b}:
                return p.link
        raise KeyError(f"no pair {a}-{b}")

    def to_json(self) -> dict[str, Any]:
        return {
            "runtime": self.runtime,
            "runtime_skipped": self.runtime_skipped,
            "devices": [d.to_json() for d in self.devices],
            "pairs": [{"a": p.a, "b": p.b, "link": p.link} for p in self.pairs],
            "nic_pairs": [{"a": p.a, "b": p.b, "link": p.link} for p in self.nic_pairs],
            "nic_rank": self.nic_rank,
            "gdr": self.gdr,
            "peer_memory": list(self.peer_memory),
            "numa_nodes": list(self.numa_nodes),
        }


# -- rules ----------------------------------------------------------------------------
def _switch_level(depth: int) -> int:
    return (depth + 1) // 2


def _common_prefix(a: tuple[str, ...], b: tuple[str, ...]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def pcie_link(a: PciFunction, b: PciFunction, *, numa_a: int, numa_b: int) -> str:
    """The PCIe class of the path between two functions (see the module docstring)."""
    if a.root != b.root:
        return "NODE" if numa_a >= 0 and numa_a == numa_b else "SYS"
    common = _common_prefix(a.chain, b.chain)
    if common == 0:
        return "PHB"
    lca = common - 1  # index of the lowest common bridge; 0 is the root port
    shared = _switch_level(lca) if lca >= 1 else None
    below_a = {_switch_level(i) for i in range(lca + 1, len(a.chain))} - {shared}
    below_b = {_switch_level(i) for i in range(lca + 1, len(b.chain))} - {shared}
    switches = (1 if shared is not None else 0) + len(below_a) + len(below_b)
    return "PIX" if switches <= 1 else "PXB"


def pcie_hops(a: PciFunction, b: PciFunction) -> int:
    """Bridges between two functions under one root complex (a tie-breaker among equal classes)."""
    return len(a.chain) + len(b.chain) - 2 * _common_prefix(a.chain, b.chain)


def resolve_numa(fn: PciFunction, nodes: Mapping[int, frozenset[int]], cpus: frozenset[int]) -> int:
    """numa_node if the firmware set it; else the one node holding all of local_cpulist; else -1.

    A machine with one NUMA node (or none listed) puts everything on node 0.
    """
    if fn.numa_node >= 0:
        return fn.numa_node
    if len(nodes) <= 1:
        return next(iter(nodes), 0)
    if cpus:
        holding = [n for n, node_cpus in nodes.items() if cpus <= node_cpus]
        if len(holding) == 1:
            return holding[0]
    return -1


def natural_key(name: str) -> list[Any]:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


def classify(devices: list[TopoDevice], device_links: Iterable[tuple[str, str, str]] = ()) -> tuple[
        list[Pair], list[Pair]]:
    """Every GPU-GPU and GPU-NIC pair (first list) and NIC-NIC pair (second), device links winning."""
    direct = {frozenset((a, b)): link for a, b, link in device_links}
    pairs: list[Pair] = []
    nic_pairs: list[Pair] = []
    for i, a in enumerate(devices):
        for b in devices[i + 1:]:
            link = direct.get(frozenset((a.id, b.id)))
            if link is None:
                link = (pcie_link(a.pci, b.pci, numa_a=a.numa_node, numa_b=b.numa_node)
                        if a.pci is not None and b.pci is not None else "SYS")
            (nic_pairs if a.kind == b.kind == "nic" else pairs).append(Pair(a.id, b.id, link))
    return pairs, nic_pairs


def rank_nics(gpu: TopoDevice, nics: list[TopoDevice], links: Mapping[tuple[str, str], str]) -> list[str]:
    """Nearest first (by link class: PIX, PXB, PHB are same root complex, NODE same NUMA node, SYS the rest);
    ties under one root complex by bridge hops, then in NIC order."""
    def key(item: tuple[int, TopoDevice]) -> tuple[int, int, int]:
        order, nic = item
        link = links[(gpu.id, nic.id)]
        klass = LINK_ORDER.index(link) if link in LINK_ORDER else len(LINK_ORDER)
        same_root = gpu.pci is not None and nic.pci is not None and gpu.pci.root == nic.pci.root
        hops = pcie_hops(gpu.pci, nic.pci) if same_root and gpu.pci and nic.pci else 0
        return klass, hops, order

    return [nic.id for _, nic in sorted(enumerate(nics), key=key)]


def gdr_capable(gpu: TopoDevice, peer_memory: Iterable[str]) -> bool:
    """Peer memory for the GPU's vendor, or dma-buf export reported by its runtime.

    NVIDIA: ``nv_mem*`` memory-peer clients or the nvidia_peermem / nv_peer_mem
    modules. Other vendors (Sunrise): any other memory-peer client (an
    assumption: no Sunrise peer-memory client name is public; see docs).
    """
    if gpu.dmabuf:
        return True
    names = list(peer_memory)
    if gpu.vendor == "nvidia":
        return any(n.startswith("nv_mem") or n in ("nvidia_peermem", "nv_peer_mem") for n in names)
    return any(not n.startswith("nv_mem") and n not in ("nvidia_peermem", "nv_peer_mem") for n in names)


def decide_gdr(gpu: TopoDevice, ranked: list[str], nics: Mapping[str, TopoDevice],
               links: Mapping[tuple[str, str], str], peer_memory: Iterable[str]) -> list[str]:
    """NICs (in rank order) for GPUDirect RDMA: path <= PXB, an ACTIVE port, peer memory or dma-buf."""
    if not gdr_capable(gpu, peer_memory):
        return []
    return [n for n in ranked if links[(gpu.id, n)] in GDR_LINKS and nics[n].active]


def nic_ports(dev: IbDevice) -> list[dict[str, Any]]:
    return [{"port": p.number, "state": p.state, "phys_state": p.phys_state, "link_layer": p.link_layer,
             "rate": p.rate, "gids": [{"index": g.index, "gid": g.gid, "type": g.type, "ndev": g.ndev}
                                      for g in p.gids]} for p in dev.ports]
