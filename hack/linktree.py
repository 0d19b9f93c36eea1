"""Mirror the package-dir mapping of pyproject.toml as a symlink tree (``<out>/daybreak``).

mypy cannot follow setuptools' ``package-dir`` (``operator/`` is
``daybreak.operator``), so ``make typecheck`` builds ``.typecheck/daybreak``
and checks that. ``python3 hack/linktree.py --selfcheck [ARGS]`` runs
``daybreak selfcheck`` from the same tree, on a bare checkout of a machine
where nothing is installed (a lent GPU machine).
"""

from __future__ import annotations

import atexit
import importlib.util
import os
import shutil
import subprocess
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


# Third-party modules the selfcheck may need, with the wheel name prefix each comes in. A GPU machine may
# have only the standard library, numpy and torch (and no registry to install from): what the check
# needs and lacks is unpacked from ``<repo>/.whl`` (carried along; ``python3 hack/linktree.py --wheels
# 3.X`` downloads them here for that Python), or the check says exactly what is missing.
WHEELS = {"pynvml": "nvidia_ml_py", "crc32c": "crc32c", "prometheus_client": "prometheus_client",
          "pydantic": "pydantic", "pydantic_core": "pydantic_core", "typing_extensions": "typing_extensions",
          "annotated_types": "annotated_types", "typing_inspection": "typing_inspection", "yaml": "PyYAML"}
MISSING_EXIT = 3


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def import_source_tree(root: Path) -> Path:
    """Make ``daybreak.*`` importable from the source folders, for ``--selfcheck`` (no install).

    Modules the interpreter lacks come from wheels in ``<root>/.whl`` when present. The tree and the
    unpacked wheels are also put on ``PYTHONPATH``, so a child process (an agent) imports the same.
    """
    tree = build(Path(tempfile.mkdtemp(prefix="daybreak-src-")))
    atexit.register(shutil.rmtree, tree, ignore_errors=True)  # the check's children exit before it does
    paths = [str(tree)]
    sys.path.insert(0, str(tree))
    wheels = sorted((root / ".whl").glob("*.whl")) if (root / ".whl").is_dir() else []
    tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
    for module, prefix in WHEELS.items():
        if _importable(module):
            continue
        for wheel in wheels:
            if wheel.name.lower().startswith(prefix.lower() + "-") and (
                    "py3-none" in wheel.name or "abi3" in wheel.name or tag in wheel.name):
                target = tree / "wheels" / wheel.stem
                with zipfile.ZipFile(wheel) as zf:
                    zf.extractall(target)
                sys.path.insert(0, str(target))
                paths.append(str(target))
                break
    importlib.invalidate_caches()
    os.environ["PYTHONPATH"] = os.pathsep.join([*paths, *filter(None, [os.environ.get("PYTHONPATH", "")])])
    return tree


def prepare(root: Path, script: str, needs: list[str]) -> None:
    """What ``--selfcheck`` does first: ``import_source_tree``, then ``require`` what it needs beyond that."""
    import_source_tree(root)
    require(script, needs)


def require(script: str, modules: list[str]) -> None:
    """Exit with ``MISSING_EXIT`` and what to do when any of ``modules`` cannot be imported (never a traceback)."""
    missing = [m for m in modules if not _importable(m)]
    if not missing:
        return
    dists = " ".join(WHEELS.get(m, m).replace("_", "-") for m in missing)
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    print(f"{script}: this Python ({sys.executable}, {version}) lacks {', '.join(missing)}. Bring them as wheels: "
          f"on a machine with a registry run `python3 hack/linktree.py --wheels {version}` (or `pip download "
          f"--only-binary :all: --python-version {version} -d .whl {dists}`) and carry .whl/ along.",
          file=sys.stderr)
    sys.exit(MISSING_EXIT)


def download_wheels(version: str) -> int:
    """Fetch every wheel in ``WHEELS`` (and their dependencies) for Python ``version`` into ``<repo>/.whl``."""
    cmd = [sys.executable, "-m", "pip", "download", "--only-binary", ":all:", "--python-version", version,
           "--platform", "manylinux2014_x86_64", "--platform", "manylinux_2_17_x86_64", "-d", str(REPO / ".whl"),
           *sorted({d.replace("_", "-") for d in WHEELS.values()})]
    return subprocess.run(cmd, check=False).returncode


# What ``daybreak selfcheck`` and the agent it starts import beyond the standard library.
SELFCHECK_NEEDS = ["pydantic", "prometheus_client", "yaml", "crc32c"]


def selfcheck(argv: list[str]) -> int:
    """``daybreak selfcheck ARGV`` from the source tree (its children import the same tree)."""
    prepare(REPO, "selfcheck", SELFCHECK_NEEDS)
    from daybreak.agent import selfcheck as check  # type: ignore[import-not-found,unused-ignore]

    status: int = check.main(argv)
    return status


if __name__ == "__main__":
    if sys.argv[1:2] in (["-h"], ["--help"]):
        print("usage: linktree.py                   build .typecheck/daybreak (make typecheck)\n"
              "       linktree.py --wheels 3.X         download the selfcheck's wheels for Python 3.X into .whl/\n"
              "       linktree.py --selfcheck [ARGS]   run `daybreak selfcheck ARGS` from this checkout, no install")
        sys.exit(0)
    if sys.argv[1:2] == ["--selfcheck"]:
        sys.exit(selfcheck(sys.argv[2:]))
    if sys.argv[1:2] == ["--wheels"] and len(sys.argv) == 3:
        sys.exit(download_wheels(sys.argv[2]))
    build(REPO / ".typecheck")
    sys.exit(0)
