"""``daybreak topo``: print this node's accelerator/NIC topology (matrix like ``nvidia-smi topo -m``, or JSON).

Works on any Linux machine: without accelerators or RDMA NICs the matrix is
empty and the runtime line says why each runtime was skipped.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import Any

from daybreak.agent.runtime import load_runtime
from daybreak.agent.topology import LEGEND, Topology, discover, parse_vendor_ids
from daybreak.logs import setup_logging


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sysfs-root", default=None, help="directory that plays /sys (default: /sys)")
    parser.add_argument("--json", action="store_true", help="print the full model as one JSON object")
    parser.add_argument("--runtime", choices=("auto", "sunrise", "nvidia", "host"), default=None,
                        help="accelerator runtime to merge in (default: auto)")
    parser.add_argument("--sunrise-lib-dir", default=None,
                        help="directory of libtangrt_shared.so/libptml_shared.so (or DAYBREAK_SUNRISE_LIB_DIR)")
    parser.add_argument("-v", "--verbose", action="store_true", help="log each runtime probe")


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.0f} GiB" if n else "memory unknown"


def render(topo: Topology) -> str:
    """The matrix, then legends, then NIC ranking with GDR marks."""
    lines: list[str] = []
    skipped = "; ".join(f"{k}: {v}" for k, v in topo.runtime_skipped.items())
    lines.append(f"Runtime: {topo.runtime}" + (f" (skipped {skipped})" if skipped else ""))
    devices = topo.devices
    if not devices:
        lines.append("No accelerators and no RDMA NICs found.")
    else:
        ids = [d.id for d in devices]
        width = max(6, *(len(i) + 2 for i in ids), *(len(p.link) + 2 for p in (*topo.pairs, *topo.nic_pairs)))
        header = " " * width + "".join(i.ljust(width) for i in ids) + "CPU Affinity".ljust(16) + "NUMA Affinity"
        lines.append(header.rstrip())
        for d in devices:
            row = d.id.ljust(width) + "".join(topo.link(d.id, other).ljust(width) for other in ids)
            if d.kind == "gpu":
                row += (d.cpu_affinity or "N/A").ljust(16) + (str(d.numa_node) if d.numa_node >= 0 else "N/A")
            lines.append(row.rstrip())
    lines += ["", "Legend:", ""]
    lines += [f"  {key:<4} = {text}" for key, text in LEGEND]
    if topo.gpus:
        lines += ["", "GPU Legend:", ""]
        for g in topo.gpus:
            extra = f", runtime index {g.runtime_index}" if g.runtime_index is not None else ""
            lines.append(f"  {g.id}: {g.pci_bus_id or '?'} {g.vendor} {g.model} ({_gib(g.memory_bytes)}{extra})")
    if topo.nics:
        lines += ["", "NIC Legend:", ""]
        for n in topo.nics:
            ports = ", ".join(f"port {p['port']} {p['state']} {p['link_layer']} {p['rate']}".strip() for p in n.ports)
            lines.append(f"  {n.id}: {n.name} ({n.pci_bus_id or 'no PCI function'}; {ports or 'no ports'})")
    if topo.gpus and topo.nics:
        lines += ["", "NIC ranking per GPU, nearest first (* = GPUDirect RDMA usable):", ""]
        for g in topo.gpus:
            gdr = set(topo.gdr.get(g.id, []))
            lines.append(f"  {g.id}: " + " ".join(n + ("*" if n in gdr else "") for n in topo.nic_rank[g.id]))
        if not any(topo.gdr.values()):
            lines.append("  (no GDR: needs a path no worse than PXB, an ACTIVE port, and peer memory or dma-buf; "
                         f"peer memory found: {', '.join(topo.peer_memory) or 'none'})")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from daybreak.agent.settings import AgentSettings

    setup_logging(logging.INFO if args.verbose else logging.WARNING)
    overrides: dict[str, Any] = {"sysfs_root": args.sysfs_root, "runtime": args.runtime,
                                 "sunrise_lib_dir": args.sunrise_lib_dir}
    try:
        settings = AgentSettings.load(overrides=overrides)
        vendors = parse_vendor_ids(settings.sunrise_pci_vendors)
    except ValueError as exc:
        print(f"daybreak topo: {exc}", file=sys.stderr)
        return 2
    if not settings.sysfs_root.is_dir():
        print(f"daybreak topo: --sysfs-root: {settings.sysfs_root} is not a directory", file=sys.stderr)
        return 2
    loaded = load_runtime(settings.runtime, sunrise_lib_dir=settings.sunrise_lib_dir)
    try:
        topo = discover(settings.sysfs_root, runtime=loaded.name, runtime_devices=loaded.runtime.devices(),
                        peer_links=loaded.runtime.peer_links(), sunrise_vendors=vendors,
                        runtime_skipped=loaded.skipped)
    finally:
        loaded.runtime.close()
    if args.json:
        json.dump(topo.to_json(), sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        print(render(topo))
    return 0
