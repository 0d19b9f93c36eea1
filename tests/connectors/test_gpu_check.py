"""hack/gpu_check.py, the issue-20 GPU check, run here in its ``--cpu`` mode: its whole code path on the Sunrise
stand-in (a real agent with HBM and DRAM tiers, two processes, the connector core, the layer pipeline, the
selfcheck). It proves the script, not a GPU figure: no GPU ran this (docs/performance.md)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from support import run_without_gpu_machine_deps

from daybreak.pool.shm import SHM_DIR

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "hack" / "gpu_check.py"


def _work_dirs() -> set[str]:
    return {p.name for p in Path(tempfile.gettempdir()).glob("daybreak-gpu-check-*")}


def test_the_gpu_check_in_cpu_mode_saves_and_loads_byte_exact_through_both_tiers_and_reports_one_json(
        tmp_path: Path) -> None:
    # The check's segments in a shared-memory directory of its own: other workers' come and go in /dev/shm.
    shm = Path(tempfile.mkdtemp(prefix="daybreak-test-gpu-check-", dir=SHM_DIR))
    try:
        _run_the_cpu_check(tmp_path, shm)
    finally:
        shutil.rmtree(shm, ignore_errors=True)


def _run_the_cpu_check(tmp_path: Path, shm: Path) -> None:
    before = _work_dirs()
    out = subprocess.run([sys.executable, str(SCRIPT), "--cpu"], capture_output=True, text=True, timeout=300,
                         cwd="/", env={**os.environ, "OUT": str(tmp_path / "out"), "PYTHONSAFEPATH": "1",
                                       "DAYBREAK_SHM_DIR": str(shm)})
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert json.loads((tmp_path / "out" / "gpu_check.json").read_text()) == summary
    assert summary["ok"] is True and summary["mode"].startswith("cpu") and summary["targets"] is None
    configs = summary["configs"]
    assert {(c["tier"], c["piece_bytes"]) for c in configs} == {(t, p) for t in ("hbm", "dram")
                                                               for p in (64 << 10, 256 << 10)}
    for c in configs:
        assert c["byte_exact"] is True, c
        assert c["save_gb_per_s"] > 0 and c["load_gb_per_s"] > 0 and c["d2h_gb_per_s"] > 0, c
        assert c["keys"] == 2 * 2 * 2  # layers x blocks x (K, V) pieces: one batch
    # The layer-by-layer saves landed the bytes each layer's kernel wrote, in both tiers.
    assert {(p["tier"], p["byte_exact"]) for p in summary["pipelined_saves"]} == {("hbm", True), ("dram", True)}
    assert summary["pipelined_loads"]["step_with_loads_seconds"] > 0
    # Device memory moved by the engines' device paths only: the link into the HBM tier, one device DMA into
    # the DRAM tier's mapped segment (counted as shm); nothing staged and nothing fell back.
    assert set(summary["transports"]["save"]) == {"link", "shm"}
    assert set(summary["transports"]["load"]) == {"link", "shm"}
    assert summary["transports"]["fell_back"] == {"save": {}, "load": {}}
    paths = {p["path"]: p for p in summary["selfcheck"]["paths"]}
    assert paths["device-pool"]["ok"] and paths["link"]["ok"], paths
    assert list(shm.iterdir()) == [] and _work_dirs() == before


def test_without_torch_the_gpu_check_names_what_to_bring_instead_of_a_traceback() -> None:
    out = run_without_gpu_machine_deps(SCRIPT)
    assert out.returncode == 3, (out.stdout, out.stderr[-2000:])
    assert "gpu_check: this Python" in out.stderr and "lacks pydantic" in out.stderr and "torch" in out.stderr
    assert "hack/linktree.py --wheels" in out.stderr and "Traceback" not in out.stderr
