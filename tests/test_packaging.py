"""Packaging: import names, the stdlib ``operator`` stays itself, optional deps stay optional."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _python(code: str) -> subprocess.CompletedProcess[str]:
    # A fresh interpreter: nothing the test session imported leaks in.
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/", timeout=120)


def test_subpackages_import_without_pyverbs_or_gpus() -> None:
    code = """
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in ('pyverbs', 'pynvml'):
            raise ImportError('blocked for the test: ' + name)
sys.meta_path.insert(0, Block())
import daybreak, daybreak.operator, daybreak.agent, daybreak.agent.transfer, daybreak.agent.store
import daybreak.api, daybreak.client
import operator
assert operator.add(2, 3) == 5, operator
assert 'site-packages' not in (operator.__file__ or '') and 'daybreak' not in (operator.__file__ or '')
print(daybreak.__version__)
"""
    proc = _python(code)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().count(".") == 2


def test_no_top_level_folder_is_importable_on_its_own() -> None:
    proc = _python("import importlib.util as u; print([m for m in ('api','agent','client') if u.find_spec(m)])")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def test_every_package_folder_is_listed_in_pyproject() -> None:
    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    mapping: dict[str, str] = config["package-dir"]
    listed = set(config["packages"])
    found = set()
    for name, folder in mapping.items():
        for init in (REPO / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(REPO / folder)
            found.add(".".join([name, *rel.parts]))
    assert found == listed, f"missing: {sorted(found - listed)}, stale: {sorted(listed - found)}"


def test_console_script_prints_version() -> None:
    exe = Path(sys.executable).parent / "daybreak"
    proc = subprocess.run([str(exe), "version", "--tools"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("daybreak ")
    assert "kubernetes v1.37" in proc.stdout
