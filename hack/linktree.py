"""Mirror the package-dir mapping of pyproject.toml as a symlink tree for mypy.

mypy cannot follow setuptools' ``package-dir`` (``operator/`` is
``daybreak.operator``), so ``make typecheck`` builds ``.typecheck/daybreak``
from symlinks and checks that instead.
"""

from __future__ import annotations

import shutil
import sys
import tomllib
from pathlib import Path


def main() -> int:
    root = Path(__file__).resolve().parent.parent
    mapping = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    out = root / ".typecheck"
    shutil.rmtree(out, ignore_errors=True)
    pkg = out / "daybreak"
    pkg.mkdir(parents=True)
    for entry in (root / mapping["daybreak"]).iterdir():
        if entry.name != "__pycache__":
            (pkg / entry.name).symlink_to(entry)
    for name, folder in mapping.items():
        if name != "daybreak":
            (pkg / name.split(".", 1)[1]).symlink_to(root / folder)
    return 0


if __name__ == "__main__":
    sys.exit(main())
