"""Read the PCI, RDMA, NUMA and peer-memory facts the topology needs from a directory that plays ``/sys``.

Symlinks are followed *inside* the root: relative links as the kernel writes
them, and absolute ``/sys/...`` links re-rooted, so a tree copied from a real
server (``cp -a`` of the relevant parts) reads the same as the live ``/sys``.
Missing files are normal (containers, old kernels, virtual devices): every
reader returns a neutral value instead of raising. Files only, no logic:
classification lives in ``classify.py``.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

ROOT_BUS = re.compile(r"^pci([0-9a-f]{4}):([0-9a-f]{2})$")
BDF = re.compile(r"^[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$")
ZERO_GID = "0000:0000:0000:0000:0000:0000:0000:0000"
MAX_GIDS = 256


@dataclass(frozen=True)
class PciFunction:
    """One PCI function and where it hangs: ``chain`` are the bridges from the root port down."""

    bdf: str
    root: str  # root bus as sysfs names it, e.g. "pci0000:00" (DRA's pcieRoot)
    chain: tuple[str, ...]
    pci_class: int
    vendor: int
    device: int
    numa_node: int  # as sysfs says; -1 is unknown
    local_cpulist: str = ""
    max_link_speed: str = ""
    max_link_width: str = ""
    current_link_speed: str = ""
    current_link_width: str = ""


@dataclass(frozen=True)
class Gid:
    index: int
    gid: str
    type: str  # "IB/RoCE v1" | "RoCE v2" | ""
    ndev: str = ""


@dataclass(frozen=True)
class IbPort:
    number: int
    state: str  # "ACTIVE", "DOWN", ... (the text after "4: ")
    phys_state: str
    link_layer: str  # "InfiniBand" | "Ethernet"
    rate: str
    gids: tuple[Gid, ...] = ()

    @property
    def active(self) -> bool:
        return self.state == "ACTIVE"


@dataclass(frozen=True)
class IbDevice:
    name: str
    bdf: str | None  # None for software devices (rxe, siw) without a PCI function
    ports: tuple[IbPort, ...]
    netdevs: tuple[str, ...]
    node_guid: str = ""


@dataclass
class SysfsSnapshot:
    """Everything read in one pass."""

    root: Path
    pci: dict[str, PciFunction] = field(default_factory=dict)
    rdma: list[IbDevice] = field(default_factory=list)
    numa_cpus: dict[int, frozenset[int]] = field(default_factory=dict)
    peer_memory: tuple[str, ...] = ()  # peer-memory clients / modules present, e.g. ("nv_mem", "nvidia_peermem")


def read_text(path: Path) -> str:
    try:
        return path.read_text(errors="replace").strip()
    except OSError:
        return ""


def read_int(path: Path, default: int, base: int = 0) -> int:
    text = read_text(path)
    try:
        return int(text, base) if text else default
    except ValueError:
        return default


def resolve(root: Path, rel: str, *, limit: int = 64) -> tuple[str, ...] | None:
    """Components of ``rel`` (relative to the root) with every symlink followed inside the root."""
    todo = [p for p in rel.split("/") if p and p != "."]
    done: list[str] = []
    hops = 0
    while todo:
        part = todo.pop(0)
        if part == "..":
            if done:
                done.pop()
            continue
        candidate = root.joinpath(*done, part)
        if candidate.is_symlink():
            hops += 1
            if hops > limit:
                return None
            target = os.readlink(candidate)
            if target.startswith("/"):
                if target != "/sys" and not target.startswith("/sys/"):
                    return None
                done, target = [], target[len("/sys"):]
            todo = [p for p in target.split("/") if p and p != "."] + todo
            continue
        done.append(part)
    return tuple(done)


def parse_cpulist(text: str) -> frozenset[int]:
    """``0-3,8,10-11`` -> {0,1,2,3,8,10,11}; bad input gives the empty set."""
    cpus: set[int] = set()
    for item in text.replace("\n", "").split(","):
        item = item.strip()
        if not item:
            continue
        try:
            if "-" in item:
                lo, hi = item.split("-", 1)
                cpus.update(range(int(lo), int(hi) + 1))
            else:
                cpus.add(int(item))
        except ValueError:
            return frozenset()
    return frozenset(cpus)


def pci_location(parts: tuple[str, ...]) -> tuple[str, tuple[str, ...]] | None:
    """(root bus, BDF chain incl. the function) from resolved path components, or None if not PCI."""
    start = None
    for i, part in enumerate(parts):
        if ROOT_BUS.match(part):
            start = i
    if start is None:
        return None
    chain = []
    for part in parts[start + 1:]:
        if not BDF.match(part):
            break
        chain.append(part)
    return (parts[start], tuple(chain)) if chain else None


def read_pci(root: Path) -> dict[str, PciFunction]:
    base = root / "bus" / "pci" / "devices"
    out: dict[str, PciFunction] = {}
    try:
        names = sorted(os.listdir(base))
    except OSError:
        return out
    for name in names:
        parts = resolve(root, f"bus/pci/devices/{name}")
        if parts is None:
            continue
        loc = pci_location(parts)
        if loc is None:
            continue
        bus, chain = loc
        d = root.joinpath(*parts)
        bdf = chain[-1]
        out[bdf] = PciFunction(
            bdf=bdf, root=bus, chain=chain[:-1],
            pci_class=read_int(d / "class", 0, 16), vendor=read_int(d / "vendor", 0, 16),
            device=read_int(d / "device", 0, 16), numa_node=read_int(d / "numa_node", -1),
            local_cpulist=read_text(d / "local_cpulist"),
            max_link_speed=read_text(d / "max_link_speed"), max_link_width=read_text(d / "max_link_width"),
            current_link_speed=read_text(d / "current_link_speed"),
            current_link_width=read_text(d / "current_link_width"),
        )
    return out


def _state(text: str) -> str:
    # "4: ACTIVE" -> "ACTIVE"; "5: LinkUp" -> "LinkUp"
    return text.split(":", 1)[1].strip() if ":" in text else text


def _read_port(port_dir: Path, number: int) -> IbPort:
    gids = []
    gid_dir = port_dir / "gids"
    try:
        indices = sorted(int(n) for n in os.listdir(gid_dir) if n.isdigit())
    except OSError:
        indices = []
    for i in indices[:MAX_GIDS]:
        gid = read_text(gid_dir / str(i))
        if not gid or gid == ZERO_GID:
            continue
        gids.append(Gid(index=i, gid=gid, type=read_text(port_dir / "gid_attrs" / "types" / str(i)),
                        ndev=read_text(port_dir / "gid_attrs" / "ndevs" / str(i))))
    return IbPort(number=number, state=_state(read_text(port_dir / "state")),
                  phys_state=_state(read_text(port_dir / "phys_state")),
                  link_layer=read_text(port_dir / "link_layer"), rate=read_text(port_dir / "rate"),
                  gids=tuple(gids))


def read_rdma(root: Path) -> list[IbDevice]:
    base = root / "class" / "infiniband"
    try:
        names = sorted(os.listdir(base))
    except OSError:
        return []
    devices = []
    for name in names:
        parts = resolve(root, f"class/infiniband/{name}")
        if parts is None:
            continue
        dev_dir = root.joinpath(*parts)
        pci_parts = resolve(root, "/".join((*parts, "device")))
        loc = pci_location(pci_parts) if pci_parts is not None else None
        ports = []
        try:
            port_names = sorted(int(p) for p in os.listdir(dev_dir / "ports") if p.isdigit())
        except OSError:
            port_names = []
        for p in port_names:
            ports.append(_read_port(dev_dir / "ports" / str(p), p))
        netdevs: tuple[str, ...] = ()
        if pci_parts is not None:
            try:
                netdevs = tuple(sorted(os.listdir(root.joinpath(*pci_parts, "net"))))
            except OSError:
                netdevs = ()
        devices.append(IbDevice(name=name, bdf=loc[1][-1] if loc else None, ports=tuple(ports), netdevs=netdevs,
                                node_guid=read_text(dev_dir / "node_guid")))
    return devices


def read_numa(root: Path) -> dict[int, frozenset[int]]:
    base = root / "devices" / "system" / "node"
    out: dict[int, frozenset[int]] = {}
    try:
        names = os.listdir(base)
    except OSError:
        return out
    for name in names:
        m = re.fullmatch(r"node(\d+)", name)
        if m:
            out[int(m.group(1))] = parse_cpulist(read_text(base / name / "cpulist"))
    return dict(sorted(out.items()))


def read_peer_memory(root: Path) -> tuple[str, ...]:
    """Peer-memory clients (``kernel/mm/memory_peers/<name>``) and modules that provide GPU peer memory."""
    found = []
    base = root / "kernel" / "mm" / "memory_peers"
    try:
        found += [n for n in sorted(os.listdir(base)) if (base / n / "version").exists()]
    except OSError:
        pass
    for module in ("nvidia_peermem", "nv_peer_mem"):
        if (root / "module" / module).is_dir():
            found.append(module)
    return tuple(found)


def snapshot(root: Path | str) -> SysfsSnapshot:
    """Read everything once; cheap enough to repeat on every refresh."""
    root = Path(root)
    return SysfsSnapshot(root=root, pci=read_pci(root), rdma=read_rdma(root), numa_cpus=read_numa(root),
                         peer_memory=read_peer_memory(root))
