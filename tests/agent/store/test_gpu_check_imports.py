"""The GPU check scripts start on a bare Python: --help and --check-imports, with pydantic absent.

The lent GPU machine's Python has torch but maybe not pydantic (and no registry). The checks must
then either import (the store and agent checks need only the standard library, numpy and
prometheus-client) or say exactly what is missing and how to bring it (exit 3, no traceback); and
with the wheels in ``.whl/`` the data path check, which does need pydantic, imports too.
"""

from __future__ import annotations

import shutil
import subprocess
import zipfile
from pathlib import Path

import pytest
from support import run_without_gpu_machine_deps

ROOT = Path(__file__).resolve().parents[3]
SCRIPTS = ["gpu_check_agent.py", "gpu_check_store.py", "gpu_check_datapath.py", "linktree.py"]


def run_blocked(script: str, *args: str) -> subprocess.CompletedProcess[str]:
    """``script args`` in this venv's interpreter with the GPU machine's absent modules failing to import."""
    return run_without_gpu_machine_deps(ROOT / "hack" / script, *args)


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_gpu_check_prints_its_help_without_the_heavy_modules(script: str) -> None:
    out = run_blocked(script, "--help")
    assert out.returncode == 0, out.stderr[-2000:]
    assert "usage" in out.stdout


@pytest.mark.parametrize("script", ["gpu_check_agent.py", "gpu_check_store.py"])
def test_the_agent_and_store_checks_import_without_pydantic(script: str) -> None:
    out = run_blocked(script, "--check-imports")
    assert out.returncode == 0, out.stderr[-2000:]
    assert "imports ok" in out.stdout


def test_the_datapath_check_names_what_is_missing_instead_of_a_traceback() -> None:
    out = run_blocked("gpu_check_datapath.py", "--check-imports")
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


def test_with_wheels_in_dot_whl_the_datapath_check_imports_on_a_python_without_pydantic(tmp_path: Path) -> None:
    bare = Path("/usr/bin/python3")
    probe = subprocess.run([str(bare), "-I", "-c", "import sys, importlib.util as u; "
                            "print(sys.version_info[:2] == (3, 11), u.find_spec('pydantic') is None)"],
                           capture_output=True, text=True) if bare.exists() else None
    if probe is None or probe.stdout.split() != ["True", "True"]:
        pytest.skip(f"needs the distribution's Python 3.11 without pydantic at {bare} (got {probe and probe.stdout})")
    # A copy of the checkout's hack/ and sources, so the test's .whl/ never lands in the real tree.
    repo = tmp_path / "repo"
    shutil.copytree(ROOT, repo, ignore=shutil.ignore_patterns(".venv*", ".git", ".typecheck", "*cache*", "tests",
                                                              "docs", "charts", "examples", ".whl"),
                    symlinks=True)
    wheels = repo / ".whl"
    wheels.mkdir()
    import annotated_types
    import prometheus_client
    import pydantic
    import pydantic_core
    import typing_extensions
    import typing_inspection

    for dist, module in (("pydantic", pydantic), ("pydantic_core", pydantic_core),
                         ("annotated_types", annotated_types), ("typing_inspection", typing_inspection),
                         ("prometheus_client", prometheus_client), ("typing_extensions", typing_extensions)):
        origin = Path(str(module.__file__))
        _fake_wheel(wheels, dist, [origin.parent if origin.name == "__init__.py" else origin])
    out = subprocess.run([str(bare), "-I", str(repo / "hack" / "gpu_check_datapath.py"), "--check-imports"],
                         capture_output=True, text=True, timeout=120, cwd="/")
    assert out.returncode == 0, out.stderr[-2000:]
    assert "imports ok" in out.stdout
