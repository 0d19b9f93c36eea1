"""Mirror the package-dir mapping of pyproject.toml as a symlink tree (``<out>/daybreak``).

mypy cannot follow setuptools' ``package-dir`` (``operator/`` is
``daybreak.operator``), so ``make typecheck`` builds ``.typecheck/daybreak``
and checks that. The GPU check scripts use the same tree to import the
package from a bare checkout on a machine where nothing is installed.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
import tomllib
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def build(out: Path) -> Path:
    """Create ``out/daybreak`` from symlinks into the checkout (replacing an old one); returns ``out``."""
    mapping = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    pkg = out / "daybreak"
    shutil.rmtree(pkg, ignore_errors=True)
    pkg.mkdir(parents=True)
    for entry in (REPO / mapping["daybreak"]).iterdir():
        if entry.name != "__pycache__":
            (pkg / entry.name).symlink_to(entry)
    for name, folder in mapping.items():
        if name != "daybreak":
            (pkg / name.split(".", 1)[1]).symlink_to(REPO / folder)
    return out


if __name__ == "__main__":
    build(REPO / ".typecheck")
    sys.exit(0)


def import_source_tree(root: Path) -> Path:
    """Make ``daybreak.*`` importable from the source folders, for the hack/ GPU check scripts (no install).

    Modules the GPU machine lacks (``pynvml``, ``crc32c``) come from wheels in ``<root>/.whl`` when present.
    """
    tree = build(Path(tempfile.mkdtemp(prefix="daybreak-src-")))
    sys.path.insert(0, str(tree))
    wheels = sorted((root / ".whl").glob("*.whl")) if (root / ".whl").is_dir() else []
    for module, prefix in (("pynvml", "nvidia_ml_py"), ("crc32c", "crc32c")):
        try:
            __import__(module)
            continue
        except ImportError:
            pass
        tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
        for wheel in wheels:
            if wheel.name.startswith(prefix) and ("py3-none" in wheel.name or tag in wheel.name):
                target = tree / "wheels" / wheel.stem
                with zipfile.ZipFile(wheel) as zf:
                    zf.extractall(target)
                sys.path.insert(0, str(target))
                break
    return tree
