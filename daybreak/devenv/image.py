"""The container image built on this machine: Debian root filesystem (mmdebstrap), OCI layers (umoci), cached.

No registry and no container runtime: ``mmdebstrap`` makes the Debian root filesystem from the machine's
own apt sources, ``umoci`` turns root filesystem changes into OCI layers in an OCI image layout under
``~/.cache/daybreak/image/oci`` (``$DAYBREAK_IMAGE_DIR``), and the steps inside the root filesystem (``image/setup.sh``, shared with
``image/Dockerfile``) run in a chroot. Three layers, each tagged in the layout by the hash of its inputs so a
rebuild redoes only what changed:

- ``base-<key>``: Debian bookworm with ``image/packages.txt`` and the user daybreak (65532);
- ``deps-<key>``: the venv ``/opt/daybreak`` with the project's runtime requirements (wheels downloaded on this
  machine, installed offline in the chroot) and Debian's pyverbs linked in;
- ``app-<key>``: the project's wheel; tagged ``<version>`` and ``latest`` once configured (user, entrypoint,
  labels).

``run`` executes the image's entrypoint in a chroot of the unpacked image (``podman run`` cannot work in this
sandbox: crun cannot set rlimits). Building and running NEED ROOT (chroot, file ownership in the layers).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import time
import tomllib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from daybreak.errors import DaybreakError
from daybreak.logs import setup_logging
from daybreak.version import __version__

logger = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parents[2]
SUITE = "bookworm"
APT_SOURCES = Path("/etc/apt/sources.list.d/debian.sources")
VENV = "/opt/daybreak"
USER = "65532:65532"
IMAGE_TITLE = "daybreak"
KEY_LABEL = "dev.daybreak.image.inputs"
# Slim like the registry's *-slim images: no manual pages, docs (copyright files kept) or translations.
DPKG_EXCLUDES = ("path-exclude=/usr/share/doc/*", "path-include=/usr/share/doc/*/copyright",
                 "path-exclude=/usr/share/man/*", "path-exclude=/usr/share/locale/*",
                 "path-exclude=/usr/share/info/*")
# pip takes a wheel's platform tags literally: every glibc up to bookworm's 2.36 has to be listed.
PLATFORM_ARGS = tuple(arg for minor in range(36, 16, -1) for arg in ("--platform", f"manylinux_2_{minor}_x86_64"))
RUN_PATH = f"{VENV}/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


class ImageError(DaybreakError, RuntimeError):
    """The image could not be built or run; the message says which step and what to do."""


@dataclass(frozen=True)
class Paths:
    """Where the build reads its inputs and keeps its outputs.

    Outputs live outside the checkout (``$DAYBREAK_IMAGE_DIR``, default ``~/.cache/daybreak/image``), like the
    control-plane tools: a fresh clone (CI's) reuses every layer whose inputs did not change.
    """

    repo: Path

    @property
    def image_dir(self) -> Path:
        return self.repo / "image"

    @property
    def out(self) -> Path:
        override = os.environ.get("DAYBREAK_IMAGE_DIR")
        return Path(override) if override else Path.home() / ".cache" / "daybreak" / "image"

    @property
    def layout(self) -> Path:
        return self.out / "oci"

    @property
    def work(self) -> Path:
        return self.out / "work"

    @property
    def wheels(self) -> Path:
        return self.out / "wheels"

    @property
    def rootfs(self) -> Path:
        """The unpacked final image that ``run`` chroots into (a runtime bundle: config.json + rootfs/)."""
        return self.out / "bundle"

    def ref(self, tag: str) -> str:
        return f"{self.layout}:{tag}"


# -- inputs and their keys ----------------------------------------------------------------------------------

def _digest(*parts: bytes) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(len(part).to_bytes(8, "big"))
        h.update(part)
    return h.hexdigest()[:16]


def packages(paths: Paths) -> list[str]:
    """Debian packages of the image (image/packages.txt without comments)."""
    text = (paths.image_dir / "packages.txt").read_text()
    return [line.strip() for line in text.splitlines() if line.strip() and not line.startswith("#")]


def requirements(paths: Paths) -> list[str]:
    """Runtime requirements, as image/setup.sh computes them inside the image (one source for both builds)."""
    out = _run(["sh", str(paths.image_dir / "setup.sh"), "requirements", str(paths.repo / "pyproject.toml")],
               step="reading the requirements", capture=True)
    return [line for line in out.splitlines() if line.strip()]


def source_files(paths: Paths) -> list[Path]:
    """Every file that goes into the wheel: the package folders of pyproject's package-dir, pyproject, README."""
    with open(paths.repo / "pyproject.toml", "rb") as f:
        project = tomllib.load(f)
    folders = sorted(set(project["tool"]["setuptools"]["package-dir"].values()))
    files = [paths.repo / "pyproject.toml", paths.repo / "README.md"]
    for folder in folders:
        for path in sorted((paths.repo / folder).rglob("*")):
            if path.is_file() and "__pycache__" not in path.parts and path.suffix not in (".pyc", ".so"):
                files.append(path)
    return files


@dataclass(frozen=True)
class Keys:
    """One key per layer; each covers its own inputs and the key of the layer below."""

    base: str
    deps: str
    app: str


def keys(paths: Paths, *, reqs: Sequence[str]) -> Keys:
    setup = (paths.image_dir / "setup.sh").read_bytes()
    pyverbs = (paths.repo / "hack" / "pyverbs.sh").read_bytes()
    sources = APT_SOURCES.read_bytes() if APT_SOURCES.exists() else b""
    base = _digest(SUITE.encode(), "\n".join(packages(paths)).encode(), "\n".join(DPKG_EXCLUDES).encode(),
                   sources, setup)
    deps = _digest(base.encode(), "\n".join(reqs).encode(), setup, pyverbs)
    tree = [p.relative_to(paths.repo).as_posix().encode() + b"\0" + p.read_bytes() for p in source_files(paths)]
    app = _digest(deps.encode(), setup, __version__.encode(), *tree)
    return Keys(base=base, deps=deps, app=app)


# -- the OCI layout -----------------------------------------------------------------------------------------

def tags(paths: Paths) -> dict[str, dict[str, Any]]:
    """Tag -> manifest descriptor, read from the layout's index.json (empty when there is no layout)."""
    index_file = paths.layout / "index.json"
    if not index_file.exists():
        return {}
    index = json.loads(index_file.read_text())
    out: dict[str, dict[str, Any]] = {}
    for desc in index.get("manifests") or []:
        name = (desc.get("annotations") or {}).get("org.opencontainers.image.ref.name")
        if name:
            out[name] = desc
    return out


def blob(paths: Paths, digest: str) -> dict[str, Any]:
    algorithm, _, hexdigest = digest.partition(":")
    return dict(json.loads((paths.layout / "blobs" / algorithm / hexdigest).read_text()))


def image_config(paths: Paths, tag: str) -> dict[str, Any]:
    """The OCI image configuration of ``tag`` (``config`` holds User, Entrypoint, Env, Labels)."""
    desc = tags(paths).get(tag)
    if desc is None:
        raise ImageError(f"no tag {tag!r} in {paths.layout}; build the image first: make image")
    manifest = blob(paths, desc["digest"])
    return blob(paths, manifest["config"]["digest"])


def image_size(paths: Paths, tag: str) -> int:
    """Compressed bytes of the layers of ``tag``."""
    manifest = blob(paths, tags(paths)[tag]["digest"])
    return sum(int(layer["size"]) for layer in manifest["layers"])


# -- running commands ---------------------------------------------------------------------------------------

def _run(argv: Sequence[str], *, step: str, capture: bool = False, env: dict[str, str] | None = None) -> str:
    logger.debug("run step=%s argv=%s", step, " ".join(argv))
    proc = subprocess.run(list(argv), capture_output=True, text=True, env=env, check=False)
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-20:])
        raise ImageError(f"{step} failed ({argv[0]} exited {proc.returncode}):\n{tail}")
    return proc.stdout if capture else ""


def _chroot_argv(root: Path, argv: Sequence[str], *, user: str | None = None,
                 env: Sequence[str] = ()) -> list[str]:
    """``argv`` in a chroot of ``root`` with its own mount and pid namespaces (/proc mounted, gone on exit)."""
    prefix = ["unshare", "--mount", "--pid", "--fork", f"--mount-proc={root / 'proc'}", "chroot"]
    if user:
        prefix.append(f"--userspec={user}")
    clean_env = ["env", "-i", *(env or (f"PATH={RUN_PATH}", "HOME=/root", "LANG=C.UTF-8"))]
    return [*prefix, str(root), *clean_env, *argv]


def _require_root_tools() -> None:
    if os.geteuid() != 0:
        raise ImageError("building the image needs root (chroot and file ownership in the layers); "
                         "run `make image` as root, or build image/Dockerfile with docker")
    missing = [tool for tool in ("mmdebstrap", "umoci", "unshare", "chroot") if shutil.which(tool) is None]
    if missing:
        raise ImageError(f"missing {', '.join(missing)}: `make image-deps` installs them (apt-get)")


@contextlib.contextmanager
def _locked(paths: Paths) -> Iterator[None]:
    """One build at a time per checkout (a test and a `make image` may race)."""
    paths.out.mkdir(parents=True, exist_ok=True)
    with open(paths.out / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


# -- the layers ---------------------------------------------------------------------------------------------

@dataclass
class BuildReport:
    """What a build did: per-layer seconds (None when the layer was cached), the final tag, its size."""

    steps: dict[str, float | None]
    tag: str
    size_bytes: int
    seconds: float


def _fresh_bundle(paths: Paths, name: str) -> Path:
    bundle = paths.work / name
    if bundle.exists():
        shutil.rmtree(bundle)
    paths.work.mkdir(parents=True, exist_ok=True)
    return bundle


def _copy_in(paths: Paths, rootfs: Path, files: Sequence[Path]) -> Path:
    """Copy build inputs to /tmp/daybreak-build inside ``rootfs`` (removed before the layer is made)."""
    target = rootfs / "tmp" / "daybreak-build"
    target.mkdir(parents=True, exist_ok=True)
    for f in files:
        if f.is_dir():
            shutil.copytree(f, target / f.name)
        else:
            shutil.copy2(f, target / f.name)
    return target


def _build_base(paths: Paths, key: str) -> None:
    tag = f"base-{key}"
    bundle = _fresh_bundle(paths, "base")
    _run(["umoci", "new", "--image", paths.ref(tag)], step="umoci new")
    _run(["umoci", "unpack", "--image", paths.ref(tag), str(bundle)], step="umoci unpack (empty base)")
    rootfs = bundle / "rootfs"
    rootfs.rmdir()  # mmdebstrap wants to create its target
    argv = ["mmdebstrap", "--variant=apt", f"--include={','.join(packages(paths))}", "--quiet",
            *(f"--dpkgopt={opt}" for opt in DPKG_EXCLUDES), SUITE, str(rootfs)]
    if APT_SOURCES.exists():
        argv.append(str(APT_SOURCES))  # the machine's own mirror (no other site is reachable here)
    _run(argv, step="mmdebstrap")
    # The build machine's resolver and name must not travel with the image (runtimes provide both).
    (rootfs / "etc" / "resolv.conf").unlink(missing_ok=True)
    (rootfs / "etc" / "hostname").write_text("")
    inside = _copy_in(paths, rootfs, [paths.image_dir / "setup.sh"])
    _run(_chroot_argv(rootfs, ["sh", "/tmp/daybreak-build/setup.sh", "user"]), step="setup.sh user")
    shutil.rmtree(inside)
    _run(["umoci", "repack", "--image", paths.ref(tag),
          f"--history.created_by=mmdebstrap --variant=apt {SUITE} + image/packages.txt; setup.sh user",
          str(bundle)], step="umoci repack (base)")
    shutil.rmtree(bundle)


def _wheelhouse(paths: Paths, reqs: Sequence[str], key: str) -> Path:
    """Wheels of the requirements, fetched by this machine's pip (its index, proxy and CA), cached by key."""
    house = paths.wheels / f"deps-{key}"
    if (house / ".complete").exists():
        return house
    if house.exists():
        shutil.rmtree(house)
    house.mkdir(parents=True)
    # Only binary wheels for CPython 3.11 on glibc x86_64: what Debian bookworm's python3 can load.
    _run([sys.executable, "-m", "pip", "download", "--quiet", "--only-binary=:all:", "--dest", str(house),
          "--python-version", "3.11", "--implementation", "cp", "--abi", "cp311", "--abi", "abi3", "--abi", "none",
          *PLATFORM_ARGS, *reqs], step="pip download (requirements)")
    (house / ".complete").write_text("\n".join(reqs) + "\n")
    return house


def _build_deps(paths: Paths, keys_: Keys, reqs: Sequence[str]) -> None:
    tag = f"deps-{keys_.deps}"
    house = _wheelhouse(paths, reqs, keys_.deps)
    bundle = _fresh_bundle(paths, "deps")
    _run(["umoci", "unpack", "--image", paths.ref(f"base-{keys_.base}"), str(bundle)], step="umoci unpack (base)")
    rootfs = bundle / "rootfs"
    inside = _copy_in(paths, rootfs, [paths.image_dir / "setup.sh", paths.repo / "pyproject.toml",
                                      paths.repo / "hack" / "pyverbs.sh", house])
    _run(_chroot_argv(rootfs, ["sh", "/tmp/daybreak-build/setup.sh", "deps", "/tmp/daybreak-build/pyproject.toml",
                               "/tmp/daybreak-build/pyverbs.sh", f"/tmp/daybreak-build/{house.name}"]),
         step="setup.sh deps")
    shutil.rmtree(inside)
    # The bundle remembers the manifest it came from: repack writes base + this layer under the new tag.
    _run(["umoci", "repack", "--image", paths.ref(tag),
          f"--history.created_by=setup.sh deps: venv {VENV} with the runtime requirements, pyverbs linked",
          str(bundle)], step="umoci repack (deps)")
    shutil.rmtree(bundle)


def _wheel(paths: Paths) -> Path:
    dist = paths.wheels / "app"
    if dist.exists():
        shutil.rmtree(dist)
    dist.mkdir(parents=True)
    _run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--wheel-dir", str(dist), str(paths.repo)],
         step="pip wheel (the project)")
    wheels = sorted(dist.glob("daybreak-*.whl"))
    if len(wheels) != 1:
        raise ImageError(f"pip wheel left {len(wheels)} daybreak wheels in {dist}; expected one")
    return wheels[0]


def _build_app(paths: Paths, keys_: Keys) -> None:
    tag = f"app-{keys_.app}"
    deps = f"deps-{keys_.deps}"
    wheel = _wheel(paths)
    bundle = _fresh_bundle(paths, "app")
    _run(["umoci", "unpack", "--image", paths.ref(deps), str(bundle)], step="umoci unpack (deps)")
    rootfs = bundle / "rootfs"
    inside = _copy_in(paths, rootfs, [paths.image_dir / "setup.sh", wheel])
    _run(_chroot_argv(rootfs, ["sh", "/tmp/daybreak-build/setup.sh", "app", f"/tmp/daybreak-build/{wheel.name}"]),
         step="setup.sh app")
    shutil.rmtree(inside)
    _run(["umoci", "repack", "--image", paths.ref(tag), f"--history.created_by=setup.sh app: {wheel.name}",
          str(bundle)], step="umoci repack (app)")
    shutil.rmtree(bundle)
    labels = {
        "org.opencontainers.image.title": IMAGE_TITLE,
        "org.opencontainers.image.version": __version__,
        "org.opencontainers.image.description": "Daybreak operator, node agent, router and sim engine",
        "org.opencontainers.image.licenses": "Apache-2.0",
        "org.opencontainers.image.base.name": f"debian:{SUITE}",
        KEY_LABEL: keys_.app,
    }
    _run(["umoci", "config", "--image", paths.ref(tag), "--no-history", f"--config.user={USER}",
          "--config.entrypoint=daybreak", "--config.cmd=--help", f"--config.env=PATH={RUN_PATH}",
          "--config.env=LANG=C.UTF-8", "--config.env=PYTHONUNBUFFERED=1", "--config.workingdir=/",
          *(f"--config.label={k}={v}" for k, v in labels.items())], step="umoci config")


def _unpack_final(paths: Paths, tag: str) -> None:
    """Keep <image dir>/bundle = the unpacked image of ``tag`` (for ``run``), redone when the digest moved."""
    digest = tags(paths)[tag]["digest"]
    stamp = paths.rootfs / "digest"
    if stamp.exists() and stamp.read_text().strip() == digest:
        return
    if paths.rootfs.exists():
        shutil.rmtree(paths.rootfs)
    _run(["umoci", "unpack", "--image", paths.ref(tag), str(paths.rootfs)], step="umoci unpack (final)")
    stamp.write_text(digest + "\n")


def _prune(paths: Paths, keep: set[str]) -> None:
    """Drop the tags of superseded layers and their blobs (gc reads every blob: only when something went)."""
    stale = [name for name in tags(paths) if name not in keep]
    for name in stale:
        _run(["umoci", "rm", "--image", paths.ref(name)], step=f"umoci rm {name}")
    if stale:
        _run(["umoci", "gc", "--layout", str(paths.layout)], step="umoci gc")
    for house in paths.wheels.glob("deps-*") if paths.wheels.exists() else ():
        if house.name not in {t for t in keep if t.startswith("deps-")}:
            shutil.rmtree(house)


def build(paths: Paths, *, progress: Callable[[str], None] = print) -> BuildReport:
    """Build (or find cached) every layer, tag ``<version>`` and ``latest``, unpack it for ``run``."""
    _require_root_tools()
    started = time.monotonic()
    with _locked(paths):
        if paths.work.exists():
            shutil.rmtree(paths.work)  # a bundle left by an interrupted build
        if not (paths.layout / "index.json").exists():
            _run(["umoci", "init", "--layout", str(paths.layout)], step="umoci init")
        reqs = requirements(paths)
        k = keys(paths, reqs=reqs)
        steps: dict[str, float | None] = {}
        for name, tag, make in (
            ("base", f"base-{k.base}", lambda: _build_base(paths, k.base)),
            ("deps", f"deps-{k.deps}", lambda: _build_deps(paths, k, reqs)),
            ("app", f"app-{k.app}", lambda: _build_app(paths, k)),
        ):
            if tag in tags(paths):
                steps[name] = None
                progress(f"image: layer {name} cached ({tag})")
                continue
            progress(f"image: building layer {name} ({tag}) ...")
            t0 = time.monotonic()
            make()
            steps[name] = time.monotonic() - t0
            progress(f"image: layer {name} built in {steps[name]:.1f} s")
        final = f"app-{k.app}"
        for alias in (__version__, "latest"):
            if tags(paths).get(alias, {}).get("digest") != tags(paths)[final]["digest"]:
                _run(["umoci", "tag", "--image", paths.ref(final), alias], step=f"umoci tag {alias}")
        _prune(paths, {f"base-{k.base}", f"deps-{k.deps}", final, __version__, "latest"})
        _unpack_final(paths, __version__)
        if paths.work.exists():
            shutil.rmtree(paths.work)
        report = BuildReport(steps=steps, tag=__version__, size_bytes=image_size(paths, __version__),
                             seconds=time.monotonic() - started)
    progress(f"image: oci:{paths.ref(report.tag)} ({report.size_bytes / 1e6:.0f} MB compressed) "
             f"in {report.seconds:.1f} s")
    return report


def run_argv(paths: Paths, args: Sequence[str], *, tag: str = __version__) -> list[str]:
    """The command that runs the image's entrypoint with ``args`` as its configured user, in a chroot."""
    config = image_config(paths, tag)["config"]
    stamp = paths.rootfs / "digest"
    if not stamp.exists() or stamp.read_text().strip() != tags(paths)[tag]["digest"]:
        raise ImageError(f"{paths.rootfs} is not the unpacked {tag}; run `make image` first")
    argv = [*config.get("Entrypoint", []), *(args or config.get("Cmd", []))]
    return _chroot_argv(paths.rootfs / "rootfs", argv, user=config.get("User"), env=config.get("Env", ()))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m daybreak.devenv.image", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command")
    sub.add_parser("build", help="build or reuse the image (the default)")
    run_p = sub.add_parser("run", help="run the image's entrypoint in a chroot: run -- version")
    run_p.add_argument("args", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    setup_logging(logging.INFO)
    paths = Paths(REPO)
    try:
        if args.command == "run":
            rest = args.args[1:] if args.args[:1] == ["--"] else list(args.args)
            _require_root_tools()
            return subprocess.call(run_argv(paths, rest))
        build(paths)
    except ImageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
