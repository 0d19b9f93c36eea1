"""The import layers a newcomer can read from the tree, checked on every module's imports (``ast``).

Lowest first: ``daybreak.errors`` (the exception root), ``daybreak.logs`` (the one logging set-up) and ``daybreak.api``
(models, no I/O) <- ``daybreak.pool`` (the pool's contract) <-
``daybreak.client`` and ``daybreak.agent`` <- ``daybreak.operator`` (which
imports nothing of the agent: the config it writes is ``api/agentconfig.py``) <- the CLI (the ``daybreak/`` folder),
``daybreak.bench`` and ``daybreak.testing``. The transfer engine and the device runtimes
(``ENGINE_LIBRARY``: ``agent/transfer/``, ``agent/runtime/``) are a library engine pods load: they
import nothing else of the agent, and they are the only part of it that ``client``, ``connectors``
and ``serving`` may import. Inside the operator the same
holds module by module (``OPERATOR_LAYERS``), and its reconcilers and planner
loop never import each other. Function-level imports count the
same as module-level ones. Each rule is also checked against a planted
violation in a throwaway tree, so the checker cannot pass by finding nothing.
"""

from __future__ import annotations

import ast
import builtins
import subprocess
import sys
import textwrap
import tomllib
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# Modules of the daybreak/ folder that are not CLI wiring: the lowest layer.
BASE_MODULES = {"daybreak", "daybreak.errors", "daybreak.logs", "daybreak.version"}
# Crossings between the two logic packages: none (the agent's config model is api.agentconfig).
OPERATOR_MAY_READ: tuple[str, ...] = ()
# Inside the operator, lowest first: a module imports from its own layer or lower ones only. The
# reconcilers and the planner loop (APART) never import each other: what they share sits below them
# (state, status writer, rollout), and the planner reaches the PDDeployment reconciler only through the
# submit_scale callable the term hands it. Modules not named here are not checked.
OPERATOR_LAYERS: tuple[tuple[str, ...], ...] = (
    ("kube", "conditions", "metrics", "workqueue", "events", "leader", "settings", "pool_policy", "engine_metrics",
     "planner", "metrics_scrape", "children"),
    ("pool", "deployment"),
    ("state",),
    ("status_writer", "agent_binding", "rollout"),
    ("pool_reconciler", "deployment_reconciler", "autoscaler"),
    ("kopf_adapter",),
    ("controller",),
    ("main",),
)
APART = 4
# The library engine pods load: the transfer engine and the device runtimes it needs. It imports nothing else of
# the agent (the agent keeps the serving side: segments, store datapath, preflight), and it is all of the agent
# that the client, the connectors and the engines may import.
ENGINE_LIBRARY = ("daybreak.agent.transfer", "daybreak.agent.runtime")
ENGINE_LIBRARY_USERS = ("daybreak.client", "daybreak.connectors", "daybreak.serving")
# Transports sit below the engine and never import it.
TRANSPORT_MODULES = ("shm", "tcp", "rdma", "link", "transport", "registry", "control")


@dataclass(frozen=True)
class Import:
    module: str  # the importing module
    path: Path
    line: int
    target: str  # the imported name, fully qualified (``from a.b import c`` -> ``a.b.c``)

    def where(self, root: Path) -> str:
        return f"{self.path.relative_to(root)}:{self.line}"


def _mapping(root: Path) -> dict[str, Path]:
    config = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    return {name: root / folder for name, folder in config.items()}


def _modules(root: Path) -> dict[str, Path]:
    """Every module of every mapped package: import name -> file."""
    out: dict[str, Path] = {}
    for package, folder in _mapping(root).items():
        for path in sorted(folder.rglob("*.py")):
            rel = path.relative_to(folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            if package == "daybreak" and parts and parts[0] != "__init__" and (folder / parts[0]).is_dir() and \
                    f"daybreak.{parts[0]}" in _mapping(root):
                continue  # a folder mapped under its own name is walked as that package
            out[".".join([package, *parts])] = path
    return out


def imports(root: Path) -> list[Import]:
    """All daybreak imports of all modules, with file and line."""
    found: list[Import] = []
    for module, path in _modules(root).items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")
                    anchor = anchor[:len(anchor) - node.level + 1]
                    base = ".".join([*anchor, *([base] if base else [])])
                targets = [f"{base}.{alias.name}" for alias in node.names]
            found += [Import(module, path, node.lineno, t) for t in targets if t.split(".")[0] == "daybreak"]
    return found


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def cli_modules(root: Path) -> list[str]:
    """The CLI layer: everything in the daybreak/ folder but the base modules."""
    folder = _mapping(root)["daybreak"]
    names = {f"daybreak.{p.stem}" for p in folder.glob("*.py")}
    names |= {f"daybreak.{p.parent.name}" for p in folder.glob("*/__init__.py")}
    return sorted(names - BASE_MODULES - {"daybreak.__init__"})


def violations(root: Path) -> list[str]:
    """Every import that breaks a layer rule, as ``file:line: module imports target (rule)``."""
    top = ["daybreak.agent", "daybreak.operator", "daybreak.bench", "daybreak.testing", *cli_modules(root)]
    rules: list[tuple[str, list[str], str]] = [
        ("daybreak.pool", [*top, "daybreak.client"], "the pool's contract stands on nothing but api and errors"),
        ("daybreak.client", top, "the client stands on daybreak.pool, never on the agent"),
        ("daybreak.api", [*top, "daybreak.pool", "daybreak.client"], "api/ holds models only"),
        ("daybreak.agent", ["daybreak.operator", "daybreak.bench", "daybreak.testing", *cli_modules(root)],
         "the agent never imports the operator, the CLI or the harnesses"),
        ("daybreak.connectors", top, "engine connectors stand on the client and api, never on agent or operator"),
        ("daybreak.serving", top, "engines and router stand on the client and api, never on agent or operator"),
        ("daybreak.operator", ["daybreak.agent", "daybreak.bench", "daybreak.testing", *cli_modules(root)],
         "the operator never imports the agent (its config model is api/agentconfig.py)"),
    ]
    transports = [f"daybreak.agent.transfer.{m}" for m in TRANSPORT_MODULES]
    out: list[str] = []
    for imp in imports(root):
        for layer, forbidden, why in rules:
            if not _under(imp.module, layer):
                continue
            if layer == "daybreak.operator" and any(_under(imp.target, ok) for ok in OPERATOR_MAY_READ):
                continue
            if layer in ENGINE_LIBRARY_USERS and any(_under(imp.target, lib) for lib in ENGINE_LIBRARY):
                continue
            if any(_under(imp.target, f) for f in forbidden):
                out.append(f"{imp.where(root)}: {imp.module} imports {imp.target} ({why})")
        if any(_under(imp.module, lib) for lib in ENGINE_LIBRARY) and _under(imp.target, "daybreak.agent") and \
                not any(_under(imp.target, lib) for lib in ENGINE_LIBRARY):
            out.append(f"{imp.where(root)}: {imp.module} imports {imp.target} (the transfer engine and the runtimes "
                       "are a library engine pods load: nothing else of the agent)")
        if (why := _operator_order(imp.module, imp.target)) is not None:
            out.append(f"{imp.where(root)}: {imp.module} imports {imp.target} ({why})")
        if imp.module in transports and _under(imp.target, "daybreak.agent.transfer.engine"):
            out.append(f"{imp.where(root)}: {imp.module} imports {imp.target} (transports report through "
                       "TransportHost, never import the engine)")
    return out


def _operator_layer(module: str) -> tuple[str, int] | None:
    if not module.startswith("daybreak.operator."):
        return None
    name = module.split(".")[2]
    return next(((name, i) for i, layer in enumerate(OPERATOR_LAYERS) if name in layer), None)


def _operator_order(module: str, target: str) -> str | None:
    """Why importing ``target`` from ``module`` breaks the operator's inner layers, or None."""
    mine, theirs = _operator_layer(module), _operator_layer(target)
    if mine is None or theirs is None or mine[0] == theirs[0]:
        return None
    if theirs[1] > mine[1]:
        return "inside the operator, lower layers never import higher ones"
    if theirs[1] == mine[1] == APART:
        return "the reconcilers and the planner loop never import each other"
    return None


def named_loggers(root: Path) -> list[str]:
    """``logging.getLogger("daybreak...")`` calls: every module logs under its ``__name__``."""
    out = []
    for _, path in _modules(root).items():
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "getLogger"
                    and node.args and isinstance(node.args[0], ast.Constant)
                    and str(node.args[0].value).startswith("daybreak")):
                out.append(f"{path.relative_to(root)}:{node.lineno}: getLogger({node.args[0].value!r})")
    return out


_BUILTIN_ERRORS = {name for name, obj in vars(builtins).items()
                   if isinstance(obj, type) and issubclass(obj, BaseException)}


def rootless_errors(root: Path) -> list[str]:
    """Exception classes derived straight from a builtin exception without ``DaybreakError`` among their bases."""
    out = []
    for module, path in _modules(root).items():
        if module == "daybreak.errors":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                bases = {b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in node.bases}
                if bases & _BUILTIN_ERRORS and "DaybreakError" not in bases:
                    out.append(f"{path.relative_to(root)}:{node.lineno}: class {node.name} does not derive from "
                               "daybreak.errors.DaybreakError")
    return out


def test_the_tree_keeps_its_layers() -> None:
    found = violations(REPO)
    assert not found, "import layer violations:\n" + "\n".join(found)


def test_every_module_logs_under_its_own_name() -> None:
    found = named_loggers(REPO)
    assert not found, "use logging.getLogger(__name__):\n" + "\n".join(found)


def test_every_exception_has_the_package_root() -> None:
    found = rootless_errors(REPO)
    assert not found, "\n".join(found)


def test_the_checks_find_planted_violations(tmp_path: Path) -> None:
    """A throwaway tree with one violation of each rule (some inside functions, one relative)."""
    (tmp_path / "pyproject.toml").write_text(textwrap.dedent("""
        [tool.setuptools.package-dir]
        "daybreak" = "daybreak"
        "daybreak.api" = "api"
        "daybreak.pool" = "pool"
        "daybreak.client" = "client"
        "daybreak.agent" = "agent"
        "daybreak.operator" = "operator"
        "daybreak.testing" = "testing"
    """))
    files = {
        "daybreak/__init__.py": "from daybreak.version import __version__\n",
        "daybreak/version.py": "__version__ = '0'\n",
        "daybreak/errors.py": "class DaybreakError(Exception):\n    pass\n",
        "daybreak/cli.py": "import daybreak.operator.main\n",
        "api/__init__.py": "",
        "api/model.py": "def f():\n    from daybreak.pool import protocol\n",
        "pool/__init__.py": "",
        "pool/protocol.py": "import logging\nlog = logging.getLogger('daybreak.pool')\n"
                            "def f():\n    import daybreak.testing.store_agent\n",
        "client/__init__.py": "",
        "client/pool.py": "from daybreak.errors import DaybreakError\nfrom daybreak.agent.store import engine\n"
                          "class Fine(DaybreakError, ValueError):\n    pass\n",
        "client/aio.py": "from .. import cli\n",
        "client/datapath.py": "from daybreak.agent.transfer import TransferEngine\n"
                              "from daybreak.agent.runtime import load_runtime\n",
        "agent/__init__.py": "",
        "agent/settings.py": "",
        "agent/transfer/__init__.py": "",
        "agent/transfer/engine.py": "",
        "agent/transfer/tcp.py": "from daybreak.agent.transfer.engine import TransferEngine\n",
        "agent/transfer/rdma.py": "from daybreak.agent.runtime.verbs import Verbs\n"
                                  "def f():\n    from daybreak.agent import verbs\n",
        "agent/runtime/__init__.py": "from . import base\nfrom ..settings import AgentSettings\n",
        "agent/runtime/base.py": "",
        "agent/main.py": "class Broken(RuntimeError):\n    pass\n",
        "operator/__init__.py": "",
        "operator/pool.py": "def f():\n    from daybreak.agent.settings import AgentSettings\n"
                            "    from daybreak.agent import main\n",
        "operator/autoscaler.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                  "    from daybreak.operator.controller import Controller\n",
        "operator/pool_reconciler.py": "from daybreak.operator.state import TermState\n"
                                       "from daybreak.operator import deployment_reconciler\n",
        "testing/__init__.py": "import daybreak.agent.main\nimport daybreak.operator.pool\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    found = violations(tmp_path)
    assert sorted(f.split(" (")[0] for f in found) == sorted([
        "api/model.py:2: daybreak.api.model imports daybreak.pool.protocol",
        "pool/protocol.py:4: daybreak.pool.protocol imports daybreak.testing.store_agent",
        "client/pool.py:2: daybreak.client.pool imports daybreak.agent.store.engine",
        "client/aio.py:1: daybreak.client.aio imports daybreak.cli",
        "agent/transfer/tcp.py:1: daybreak.agent.transfer.tcp imports daybreak.agent.transfer.engine.TransferEngine",
        "agent/transfer/rdma.py:3: daybreak.agent.transfer.rdma imports daybreak.agent.verbs",
        "agent/runtime/__init__.py:2: daybreak.agent.runtime imports daybreak.agent.settings.AgentSettings",
        "operator/pool.py:2: daybreak.operator.pool imports daybreak.agent.settings.AgentSettings",
        "operator/pool.py:3: daybreak.operator.pool imports daybreak.agent.main",
        "operator/autoscaler.py:3: daybreak.operator.autoscaler imports daybreak.operator.controller.Controller",
        "operator/pool_reconciler.py:2: daybreak.operator.pool_reconciler imports "
        "daybreak.operator.deployment_reconciler",
    ]), found
    assert named_loggers(tmp_path) == ["pool/protocol.py:2: getLogger('daybreak.pool')"]
    assert rootless_errors(tmp_path) == [
        "agent/main.py:1: class Broken does not derive from daybreak.errors.DaybreakError"]


def test_loading_the_client_loads_no_agent_module() -> None:
    """What a newcomer notices first: ``import daybreak.client`` runs only the client and the pool's contract."""
    code = "import sys, daybreak.client; print('\\n'.join(sorted(m for m in sys.modules if m.startswith('daybreak'))))"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/", timeout=60)
    assert proc.returncode == 0, proc.stderr
    loaded = proc.stdout.split()
    stray = [m for m in loaded if m not in BASE_MODULES and not _under(m, "daybreak.client") and
             not _under(m, "daybreak.pool")]
    assert not stray, f"import daybreak.client also loads {stray}"
    assert "daybreak.pool.connection" in loaded
