"""Topology on the four sysfs fixture trees: link classes, NIC ranking and GDR, against matrices written by hand.

The expected matrices below were worked out from the layouts in
tests/fixtures/sysfs/make_trees.py (which switch and root port each device
hangs from), not copied from the code's output.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from daybreak.agent.topology import discover

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "sysfs"
DAYBREAK = str(Path(sys.executable).parent / "daybreak")


def matrix(text: str) -> dict[tuple[str, str], str]:
    """Parse a hand-written upper-triangle matrix (first row = column ids)."""
    rows = [line.split() for line in text.strip().splitlines()]
    cols = rows[0]
    out = {}
    for row in rows[1:]:
        for col, cell in zip(cols, row[1:], strict=True):
            if cell not in ("X", "."):
                out[(row[0], col)] = cell
    return out


def links_of(topo: Any) -> dict[tuple[str, str], str]:
    return {(p.a, p.b): p.link for p in topo.pairs}


# -- dgx8: two sockets; socket 0 = root complexes 00 and 20, socket 1 = 80 and a0 ------------------------
# GPU0 03:00.0, NIC0 04:00.0 and GPU1 05:00.0 sit under switch 01:00.0 (root port 00:01.0).
# GPU2 0b:00.0 and NIC1 0c:00.0 under switch 09:00.0, itself under switch 07:00.0 (root port 00:02.0),
# GPU3 0d:00.0 directly under switch 07:00.0. NIC2/NIC3 are the two functions 21:00.0/.1 on root port 20:01.0.
# GPU4, NIC4, GPU5, NIC5 (port DOWN) under switch 81:00.0; GPU6, NIC6, GPU7, NIC7 under switch a1:00.0.
DGX8 = matrix("""
      GPU1 GPU2 GPU3 GPU4 GPU5 GPU6 GPU7 NIC0 NIC1 NIC2 NIC3 NIC4 NIC5 NIC6 NIC7
GPU0  PIX  PHB  PHB  SYS  SYS  SYS  SYS  PIX  PHB  NODE NODE SYS  SYS  SYS  SYS
GPU1  X    PHB  PHB  SYS  SYS  SYS  SYS  PIX  PHB  NODE NODE SYS  SYS  SYS  SYS
GPU2  .    X    PXB  SYS  SYS  SYS  SYS  PHB  PIX  NODE NODE SYS  SYS  SYS  SYS
GPU3  .    .    X    SYS  SYS  SYS  SYS  PHB  PXB  NODE NODE SYS  SYS  SYS  SYS
GPU4  .    .    .    X    PIX  NODE NODE SYS  SYS  SYS  SYS  PIX  PIX  NODE NODE
GPU5  .    .    .    .    X    NODE NODE SYS  SYS  SYS  SYS  PIX  PIX  NODE NODE
GPU6  .    .    .    .    .    X    PIX  SYS  SYS  SYS  SYS  NODE NODE PIX  PIX
GPU7  .    .    .    .    .    .    X    SYS  SYS  SYS  SYS  NODE NODE PIX  PIX
""")
DGX8_RANK = {
    "GPU0": ["NIC0", "NIC1", "NIC2", "NIC3", "NIC4", "NIC5", "NIC6", "NIC7"],
    "GPU1": ["NIC0", "NIC1", "NIC2", "NIC3", "NIC4", "NIC5", "NIC6", "NIC7"],
    "GPU2": ["NIC1", "NIC0", "NIC2", "NIC3", "NIC4", "NIC5", "NIC6", "NIC7"],
    "GPU3": ["NIC1", "NIC0", "NIC2", "NIC3", "NIC4", "NIC5", "NIC6", "NIC7"],
    "GPU4": ["NIC4", "NIC5", "NIC6", "NIC7", "NIC0", "NIC1", "NIC2", "NIC3"],
    "GPU5": ["NIC4", "NIC5", "NIC6", "NIC7", "NIC0", "NIC1", "NIC2", "NIC3"],
    "GPU6": ["NIC6", "NIC7", "NIC4", "NIC5", "NIC0", "NIC1", "NIC2", "NIC3"],
    "GPU7": ["NIC6", "NIC7", "NIC4", "NIC5", "NIC0", "NIC1", "NIC2", "NIC3"],
}
# nvidia_peermem is loaded; GDR needs PIX/PXB and an ACTIVE port (NIC5 is down).
DGX8_GDR = {"GPU0": ["NIC0"], "GPU1": ["NIC0"], "GPU2": ["NIC1"], "GPU3": ["NIC1"], "GPU4": ["NIC4"],
            "GPU5": ["NIC4"], "GPU6": ["NIC6", "NIC7"], "GPU7": ["NIC6", "NIC7"]}
DGX8_BUS = {"GPU0": "0000:03:00.0", "GPU1": "0000:05:00.0", "GPU2": "0000:0b:00.0", "GPU3": "0000:0d:00.0",
            "GPU4": "0000:83:00.0", "GPU5": "0000:85:00.0", "GPU6": "0000:a3:00.0", "GPU7": "0000:a5:00.0",
            "NIC0": "0000:04:00.0", "NIC1": "0000:0c:00.0", "NIC2": "0000:21:00.0", "NIC3": "0000:21:00.1",
            "NIC4": "0000:84:00.0", "NIC5": "0000:86:00.0", "NIC6": "0000:a4:00.0", "NIC7": "0000:a6:00.0"}

# -- box4: one socket, Sunrise parts; GPU0/GPU1/NIC0 under switch 01:00.0, GPU2/GPU3 under switch 10:00.0 ----
BOX4 = matrix("""
      GPU1 GPU2 GPU3 NIC0
GPU0  PIX  PHB  PHB  PIX
GPU1  X    PHB  PHB  PIX
GPU2  .    X    PIX  PHB
GPU3  .    .    X    PHB
""")

# -- numa_unknown: numa_node -1 everywhere; GPU1 and NIC1 have local_cpulist 16-31 = node 1 -----------------
NUMA_UNKNOWN = matrix("""
      GPU1 NIC0 NIC1
GPU0  SYS  PIX  SYS
GPU1  X    SYS  NODE
""")


def test_dgx8_links_rank_gdr_and_ids() -> None:
    topo = discover(FIXTURES / "dgx8")
    assert links_of(topo) == DGX8
    assert topo.nic_rank == DGX8_RANK
    assert topo.gdr == DGX8_GDR
    assert {d.id: d.pci_bus_id for d in topo.devices} == DGX8_BUS
    # The ASPEED VGA (display class, other vendor), NVSwitch bridges, NVMe and the X710 are not devices.
    assert [n.name for n in topo.nics] == [f"mlx5_{i}" for i in range(8)]
    assert {d.id: d.numa_node for d in topo.devices if d.kind == "gpu"} == {
        "GPU0": 0, "GPU1": 0, "GPU2": 0, "GPU3": 0, "GPU4": 1, "GPU5": 1, "GPU6": 1, "GPU7": 1}
    nic5 = next(n for n in topo.nics if n.name == "mlx5_5")
    assert not nic5.active and nic5.ports[0]["state"] == "DOWN"
    nic2 = next(n for n in topo.nics if n.name == "mlx5_2")
    assert nic2.netdevs == ["ens1f0np0"] and nic2.ports[0]["link_layer"] == "Ethernet"
    # two zero GIDs per port in the tree are skipped; RoCE v2 GIDs carry their netdev
    assert [(g["index"], g["type"]) for g in nic2.ports[0]["gids"]] == [
        (0, "IB/RoCE v1"), (1, "RoCE v2"), (2, "IB/RoCE v1"), (3, "RoCE v2")]
    assert nic2.ports[0]["gids"][3]["gid"].endswith("ffff:0a00:0015") and nic2.ports[0]["gids"][3]["ndev"] == "ens1f0np0"
    assert topo.peer_memory == ("nvidia_peermem",)


def test_box4_sunrise_without_peer_memory_has_no_gdr() -> None:
    topo = discover(FIXTURES / "box4")
    assert links_of(topo) == BOX4
    assert topo.nic_rank == {g: ["NIC0"] for g in ("GPU0", "GPU1", "GPU2", "GPU3")}
    assert topo.gdr == {g: [] for g in ("GPU0", "GPU1", "GPU2", "GPU3")}
    assert {g.vendor for g in topo.gpus} == {"sunrise"}
    assert [g.pci_bus_id for g in topo.gpus] == ["0000:03:00.0", "0000:04:00.0", "0000:12:00.0", "0000:13:00.0"]


def test_box4_with_an_unknown_vendor_list_finds_no_sunrise_parts() -> None:
    topo = discover(FIXTURES / "box4", sunrise_vendors=(0x1234,))
    assert topo.gpus == [] and [n.name for n in topo.nics] == ["mlx5_0"]


def test_nonic_node() -> None:
    topo = discover(FIXTURES / "nonic")
    assert links_of(topo) == {("GPU0", "GPU1"): "PHB"}
    assert topo.nics == []
    assert topo.nic_rank == {"GPU0": [], "GPU1": []} and topo.gdr == {"GPU0": [], "GPU1": []}
    # GPU0 is a VGA-class (0x0300) NVIDIA part, GPU1 a 3D controller (0x0302)
    assert [g.pci_bus_id for g in topo.gpus] == ["0000:01:00.0", "0000:02:00.0"]


def test_numa_unknown_node() -> None:
    topo = discover(FIXTURES / "numa_unknown")
    assert links_of(topo) == NUMA_UNKNOWN
    assert {d.id: (d.numa_node, d.sysfs_numa_node) for d in topo.devices} == {
        "GPU0": (-1, -1), "GPU1": (1, -1), "NIC0": (-1, -1), "NIC1": (1, -1)}
    assert topo.nic_rank == {"GPU0": ["NIC0", "NIC1"], "GPU1": ["NIC1", "NIC0"]}
    # nv_mem peer memory; only GPU0-NIC0 (PIX) is close enough
    assert topo.gdr == {"GPU0": ["NIC0"], "GPU1": []}


def _topo_json(root: Path, *extra: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    proc = subprocess.run([DAYBREAK, "topo", "--sysfs-root", str(root), "--json", *extra], capture_output=True,
                          text=True, timeout=60, env={**os.environ, **(env or {})})
    assert proc.returncode == 0, proc.stderr
    return dict(json.loads(proc.stdout))


@pytest.mark.parametrize("name", ["dgx8", "box4", "nonic", "numa_unknown"])
def test_topo_json_interface(name: str) -> None:
    out = _topo_json(FIXTURES / name, "--runtime", "host")
    ids = [d["id"] for d in out["devices"]]
    for d in out["devices"]:
        assert set(d) >= {"id", "kind", "pci_bus_id", "numa_node"} and d["kind"] in ("gpu", "nic")
    for p in out["pairs"]:
        assert set(p) >= {"a", "b", "link"} and p["a"] in ids and p["b"] in ids
    gpus = [i for i in ids if i.startswith("GPU")]
    assert set(out["nic_rank"]) == set(gpus) == set(out["gdr"])
    expected = {"dgx8": DGX8, "box4": BOX4, "nonic": {("GPU0", "GPU1"): "PHB"}, "numa_unknown": NUMA_UNKNOWN}[name]
    assert {(p["a"], p["b"]): p["link"] for p in out["pairs"]} == expected


def test_topo_matrix_text_on_a_fixture() -> None:
    proc = subprocess.run([DAYBREAK, "topo", "--sysfs-root", str(FIXTURES / "numa_unknown"), "--runtime", "host"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    header = next(line for line in lines if line.lstrip().startswith("GPU0"))
    assert header.split()[:4] == ["GPU0", "GPU1", "NIC0", "NIC1"]
    gpu1 = next(line for line in lines if line.startswith("GPU1 "))
    assert gpu1.split()[:6] == ["GPU1", "SYS", "X", "SYS", "NODE", "16-31"]
    assert "  NIC0: mlx5_0 (0000:04:00.0; port 1 ACTIVE InfiniBand 400 Gb/sec (4X NDR))" in lines
    assert "  GPU0: NIC0* NIC1" in lines and "  GPU1: NIC1 NIC0" in lines
    assert any(line.startswith("  PIX  = ") for line in lines)


def test_topo_runs_on_this_machine() -> None:
    proc = subprocess.run([DAYBREAK, "topo"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("Runtime: ")
    out = _topo_json(Path("/sys"))
    assert set(out) >= {"devices", "pairs", "nic_rank", "gdr"}


def test_topo_rejects_a_missing_root(tmp_path: Path) -> None:
    proc = subprocess.run([DAYBREAK, "topo", "--sysfs-root", str(tmp_path / "nope")], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2 and "--sysfs-root" in proc.stderr


def test_a_copied_tree_with_absolute_sys_links_reads_the_same(tmp_path: Path) -> None:
    """A tree copied from a server where a tool rewrote links as absolute /sys/... paths still resolves."""
    copy = tmp_path / "sys"
    shutil.copytree(FIXTURES / "dgx8", copy, symlinks=True)
    for link in [*copy.joinpath("bus", "pci", "devices").iterdir(), *copy.joinpath("class", "infiniband").iterdir()]:
        target = (link.parent / os.readlink(link)).resolve()
        link.unlink()
        link.symlink_to("/sys/" + str(target.relative_to(copy.resolve())))
    topo = discover(copy)
    assert links_of(topo) == DGX8 and topo.gdr == DGX8_GDR


def test_committed_trees_match_the_generator(tmp_path: Path) -> None:
    sys.path.insert(0, str(FIXTURES))
    try:
        import make_trees
    finally:
        sys.path.remove(str(FIXTURES))
    make_trees.generate(tmp_path)
    for name in make_trees.LAYOUTS:
        want, have = _listing(tmp_path / name), _listing(FIXTURES / name)
        assert want == have, f"tests/fixtures/sysfs/{name} is stale: run python tests/fixtures/sysfs/make_trees.py"


def _listing(root: Path) -> dict[str, str]:
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in [*dirnames, *filenames]:
            p = Path(dirpath) / name
            rel = str(p.relative_to(root))
            if p.is_symlink():
                out[rel] = "-> " + os.readlink(p)
            elif p.is_file():
                out[rel] = p.read_text()
    return out
