"""``daybreak selfcheck`` on this machine: shm, tcp and the pool for real, rdma through the fake verbs,
the device link and device-to-pool through the gcc-built Sunrise runtime (real dlopen/ctypes path)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from agent.transfer.test_transfer_rdma import Fabric, fake_verbs
from sunrise_lib.build import build, node
from support import run_without_gpu_machine_deps

from daybreak.agent.selfcheck import PATHS, Options, PathResult, exit_status, run_checks
from daybreak.pool.shm import SHM_DIR

ROOT = Path(__file__).resolve().parents[2]
MiB = 1 << 20
BUSES = ["0000:12:00.0", "0000:13:00.0"]


def _selfcheck(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(Path(sys.executable).with_name("daybreak")), "selfcheck", *args],
                          capture_output=True, text=True, timeout=300, env=env)


def _leftovers() -> set[str]:
    return {p.name for p in SHM_DIR.glob("daybreak-selfcheck-*")}


@pytest.fixture
def sunrise(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Two fake Sunrise chips joined by a link; child processes (the link peer, the agent) see the same."""
    libdir = build(tmp_path_factory.mktemp("sunrise-lib"))
    monkeypatch.setenv("DAYBREAK_FAKE_SUNRISE", node(BUSES, links=[[0, 0, 1, 0]], memory_bytes=256 * MiB))
    monkeypatch.delenv("DAYBREAK_FAKE_SUNRISE_FAIL", raising=False)
    yield str(libdir)


def test_the_command_moves_real_bytes_over_shm_tcp_and_a_pool_and_prints_json() -> None:
    before = _leftovers()
    out = _selfcheck("--json", "--mib", "8", "--runtime", "host")
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout)
    by_path = {p["path"]: p for p in report["paths"]}
    assert list(by_path) == list(PATHS)
    for name in ("shm", "tcp", "pool"):
        entry = by_path[name]
        assert entry["ok"] is True and entry["reason"] is None, entry
        assert isinstance(entry["gb_per_s"], float) and entry["gb_per_s"] > 0
    for name in ("device", "link", "device-pool"):  # no accelerator runtime asked for: absent, not failed
        entry = by_path[name]
        assert entry == {"path": name, "ok": False, "gb_per_s": None, "absent": True,
                         "reason": "no accelerator (runtime host)"}
    rdma = by_path["rdma"]  # this machine has no RDMA device (and maybe no pyverbs): absent, with why
    assert rdma["ok"] is False and rdma["absent"] is True and rdma["gb_per_s"] is None and rdma["reason"]
    assert _leftovers() == before  # the private agent's and the shm path's segments are gone


def test_the_text_report_names_each_path_and_the_verdict() -> None:
    out = _selfcheck("--paths", "shm,link", "--mib", "4", "--runtime", "host")
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert lines[0].split()[:2] == ["shm", "ok"] and lines[0].endswith("GB/s")
    assert lines[1].split()[:2] == ["link", "absent"] and "no accelerator" in lines[1]
    assert lines[-1] == "SELFCHECK PASSED"


def test_an_absent_path_fails_only_when_required_and_unknown_paths_are_refused() -> None:
    out = _selfcheck("--paths", "link", "--require", "link", "--mib", "1", "--runtime", "host")
    assert out.returncode == 1 and out.stdout.splitlines()[-1] == "SELFCHECK FAILED"
    bad = _selfcheck("--paths", "shm,nvme")
    assert bad.returncode == 2 and "--paths: unknown path(s) ['nvme']" in bad.stderr
    assert exit_status([PathResult("rdma", ok=False, reason="no RDMA device", absent=True)]) == 0
    assert exit_status([PathResult("tcp", ok=False, reason="the bytes read back differ")]) == 1


def test_rdma_through_the_fake_verbs_is_byte_exact() -> None:
    [result] = run_checks(["rdma"], options=Options(size_bytes=8 * MiB), verbs=fake_verbs(Fabric(), ["mlx5_0"]))
    assert result.ok, result.reason
    assert result.gb_per_s is not None and result.gb_per_s > 0


def test_rdma_without_a_device_is_absent_with_the_cause() -> None:
    [result] = run_checks(["rdma"], options=Options(size_bytes=MiB), verbs=fake_verbs(Fabric(), []))
    assert result.absent and not result.ok and result.gb_per_s is None
    assert result.reason == "no RDMA devices: Failed to get devices list"


def test_device_copies_the_device_link_and_device_to_pool_run_through_the_sunrise_runtime(sunrise: str) -> None:
    before = _leftovers()
    options = Options(size_bytes=8 * MiB, block_bytes=2 * MiB, runtime="sunrise", sunrise_lib_dir=sunrise)
    device, link, pool = run_checks(["device", "link", "device-pool"], options=options)
    assert device.ok and device.gb_per_s is not None and device.gb_per_s > 0, device.reason
    assert link.ok and link.path == "link", link.reason
    assert link.gb_per_s is not None and link.gb_per_s > 0
    assert pool.ok and pool.path == "device-pool", pool.reason
    assert pool.gb_per_s is not None and pool.gb_per_s > 0
    assert _leftovers() == before


def test_a_link_that_fails_is_reported_broken_and_fails_the_check(sunrise: str,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    # The runtime library refuses peer copies: the engine falls back to tcp, which the check must call a failure.
    monkeypatch.setenv("DAYBREAK_FAKE_SUNRISE_FAIL", "tangMemcpyPeer=719")
    [link] = run_checks(["link"], options=Options(size_bytes=2 * MiB, runtime="sunrise", sunrise_lib_dir=sunrise))
    assert not link.ok and not link.absent
    assert link.reason is not None and "not the link alone (fell back link -> tcp" in link.reason
    assert exit_status([link]) == 1


def test_the_nvidia_runtime_without_a_gpu_is_absent_with_nvmls_reason() -> None:
    [device] = run_checks(["device"], options=Options(size_bytes=MiB, runtime="nvidia"))
    assert device.absent and not device.ok
    assert device.reason is not None and device.reason.startswith("no accelerator (nvidia: nvmlInit failed")


# -- a bare machine: the lent GPU machine's Python may lack pydantic and has no registry ------------------------

def test_on_a_python_without_pydantic_the_source_tree_selfcheck_names_what_to_bring() -> None:
    out = run_without_gpu_machine_deps(ROOT / "hack" / "linktree.py", "--selfcheck", "--paths", "shm")
    assert out.returncode == 3, (out.stdout, out.stderr[-2000:])
    assert "lacks pydantic" in out.stderr and "hack/linktree.py --wheels" in out.stderr
    assert "Traceback" not in out.stderr


def _fake_wheel(dest: Path, dist: str, paths: list[Path]) -> None:
    """A wheel-shaped zip of installed modules (what ``pip download`` would bring, for this test only)."""
    with zipfile.ZipFile(dest / f"{dist}-0-py3-none-any.whl", "w") as zf:
        for top in paths:
            files = [top] if top.is_file() else [f for f in top.rglob("*") if f.is_file() and "__pycache__" not in f.parts]
            for f in files:
                zf.write(f, f.relative_to(top.parent))


def test_with_wheels_in_dot_whl_a_bare_python_runs_the_selfcheck_from_the_checkout(tmp_path: Path) -> None:
    bare = Path("/usr/bin/python3")
    probe = subprocess.run([str(bare), "-I", "-c", "import sys, importlib.util as u; "
                            "print(sys.version_info[:2] == (3, 11), u.find_spec('pydantic') is None)"],
                           capture_output=True, text=True) if bare.exists() else None
    if probe is None or probe.stdout.split() != ["True", "True"]:
        pytest.skip(f"needs the distribution's Python 3.11 without pydantic at {bare} (got {probe and probe.stdout})")
    # A copy of the checkout's sources, so the test's .whl/ never lands in the real tree.
    repo = tmp_path / "repo"
    shutil.copytree(ROOT, repo, ignore=shutil.ignore_patterns(".venv*", ".git", ".typecheck", "*cache*", "tests",
                                                              "docs", "charts", "examples", ".whl"),
                    symlinks=True)
    wheels = repo / ".whl"
    wheels.mkdir()
    import annotated_types
    import crc32c
    import prometheus_client
    import pydantic
    import pydantic_core
    import typing_extensions
    import typing_inspection

    for dist, module in (("pydantic", pydantic), ("pydantic_core", pydantic_core),
                         ("annotated_types", annotated_types), ("typing_inspection", typing_inspection),
                         ("prometheus_client", prometheus_client), ("typing_extensions", typing_extensions),
                         ("crc32c", crc32c)):
        origin = Path(str(module.__file__))
        top = origin.parent if origin.name == "__init__.py" else origin
        # crc32c reads its own version from its metadata, as a real wheel carries it
        _fake_wheel(wheels, dist, [top, *top.parent.glob(f"{dist}-*.dist-info")])
    out = subprocess.run([str(bare), "-I", str(repo / "hack" / "linktree.py"), "--selfcheck", "--json",
                          "--paths", "shm,tcp,pool", "--mib", "4", "--runtime", "host"],
                         capture_output=True, text=True, timeout=300, cwd="/")
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout)
    assert [(p["path"], p["ok"]) for p in report["paths"]] == [("shm", True), ("tcp", True), ("pool", True)]
