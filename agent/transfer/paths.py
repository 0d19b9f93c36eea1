"""Path planning for rdma (pure logic): which NIC carries each slice, and when device memory is staged first.

Rules (DESIGN section 6, issue 6):
- host memory: slices are striped round-robin over the NICs that have a live
  queue pair to the peer, in rank order;
- device memory: each device's slices go through that device's GDR-capable
  NICs (path no worse than PXB, peer memory or dma-buf; nearest first);
- a device with no GDR-capable NIC stages its slices over the device link to
  a linked device that has one (never through host memory when a link exists);
  only a device with neither stages through host memory.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from daybreak.errors import DaybreakError


@dataclass
class TopologyView:
    """The part of the node topology the transfer engine uses, keyed by runtime device index and NIC name."""

    nics: list[str] = field(default_factory=list)  # every usable NIC, best first for host memory
    ranked: dict[int, list[str]] = field(default_factory=dict)  # device -> NICs nearest first
    gdr: dict[int, list[str]] = field(default_factory=dict)  # device -> NICs usable for GPUDirect, nearest first
    links: dict[int, list[int]] = field(default_factory=dict)  # device -> devices with a direct link, widest first

    @classmethod
    def from_topology(cls, topology: Any) -> TopologyView:
        """Adapt ``daybreak.agent.topology.Topology`` (ids like GPU0/NIC1) to device indices and NIC names."""
        names = {d.id: d.name for d in topology.nics}
        # runtime order where a runtime reported the devices; else the topology's GPU<n> numbering
        index = {d.id: d.runtime_index if d.runtime_index is not None else int(d.id[3:])
                 for d in topology.gpus if d.runtime_index is not None or d.id[3:].isdigit()}
        view = cls(nics=[d.name for d in topology.nics if d.active] or [d.name for d in topology.nics])
        for gpu_id, device in index.items():
            view.ranked[device] = [names[n] for n in topology.nic_rank.get(gpu_id, []) if n in names]
            view.gdr[device] = [names[n] for n in topology.gdr.get(gpu_id, []) if n in names]
        widths: dict[int, list[tuple[int, int]]] = {}
        for pair in topology.pairs:
            if pair.a in index and pair.b in index and pair.link[:2] in ("SL", "NV"):
                width = int(pair.link[2:] or 1)
                widths.setdefault(index[pair.a], []).append((width, index[pair.b]))
                widths.setdefault(index[pair.b], []).append((width, index[pair.a]))
        view.links = {d: [p for _, p in sorted(ws, key=lambda w: -w[0])] for d, ws in widths.items()}
        return view


@dataclass(frozen=True)
class SliceSpec:
    """One slice to place: its position in the batch and the device its local bytes live on (None: host)."""

    key: Any
    device: int | None


@dataclass(frozen=True)
class Placement:
    key: Any
    nic: str
    stage_device: int | None = None  # copy to this device over the link first
    stage_host: bool = False  # copy through host memory first (no GDR NIC and no linked device with one)


class NoPath(DaybreakError):
    """No live NIC can carry the slice."""


def plan(slices: Iterable[SliceSpec], *, view: TopologyView, live: Sequence[str],
         exclude: Mapping[Any, Iterable[str]] | None = None) -> list[Placement]:
    """Place every slice on a NIC from ``live`` (NICs with a working queue pair to the peer).

    ``exclude[key]`` lists NICs that already failed this slice (the retry goes elsewhere).
    Raises ``NoPath`` when some slice has no live NIC at all.
    """
    live_set = list(dict.fromkeys(live))
    if not live_set:
        raise NoPath("no NIC has a live queue pair to the peer")
    cursors: dict[tuple[str, ...], itertools.cycle[str]] = {}
    out: list[Placement] = []
    excluded = exclude or {}

    def pick(candidates: Sequence[str], key: Any) -> str | None:
        banned = set(excluded.get(key, ()))
        usable = tuple(n for n in candidates if n in live_set and n not in banned)
        if not usable:
            return None
        cycle = cursors.setdefault(usable, itertools.cycle(usable))
        return next(cycle)

    for spec in slices:
        if spec.device is None:
            host_order = [n for n in view.nics if n in live_set] + [n for n in live_set if n not in view.nics]
            nic = pick(host_order, spec.key)
            if nic is None:
                raise NoPath(f"slice {spec.key}: every live NIC already failed it")
            out.append(Placement(spec.key, nic))
            continue
        nic = pick(view.gdr.get(spec.device, []), spec.key)
        if nic is not None:
            out.append(Placement(spec.key, nic))
            continue
        staged = None
        for peer in view.links.get(spec.device, []):
            nic = pick(view.gdr.get(peer, []), spec.key)
            if nic is not None:
                staged = Placement(spec.key, nic, stage_device=peer)
                break
        if staged is not None:
            out.append(staged)
            continue
        nic = pick(view.ranked.get(spec.device, []) + live_set, spec.key)
        if nic is None:
            raise NoPath(f"slice {spec.key}: every live NIC already failed it")
        out.append(Placement(spec.key, nic, stage_host=True))
    return out
