"""The ``daybreak`` console script: one entry point, one sub-command per concern.

Each sub-command lives in its own module, imported only when it runs, so
``daybreak version`` never pays for kopf or the accelerator probes. A module
listed here provides ``add_arguments(parser)`` and ``run(args) -> int``.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from typing import Protocol, cast

# name -> (module, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "version": ("daybreak.version_cmd", "print the Daybreak version"),
    "dev": ("daybreak.devenv.cmd", "build local tools and run a local Kubernetes cluster"),
    "operator": ("daybreak.operator.main", "run the operator"),
    "agent": ("daybreak.agent.main", "run the node agent"),
    "topo": ("daybreak.agent.topo_cmd", "print the accelerator/NIC topology of this machine"),
    "selfcheck": ("daybreak.agent.selfcheck", "move a pattern through every data path of this node (GB/s, byte-exact)"),
    "bench": ("daybreak.bench.cmd", "run benchmarks against their anchors"),
    "crds": ("daybreak.api.crdgen", "generate CRD YAML from the API models"),
    "sim-engine": ("daybreak.serving.sim", "run a simulated prefill or decode engine"),
    "router": ("daybreak.serving.router", "run the PD request router"),
    "load": ("daybreak.serving.load", "replay a trace or generate sessions against an OpenAI-compatible URL"),
    "status": ("daybreak.status", "show pools, deployments, tiers, hit rates and node topology"),
    "credentials": ("daybreak.credentials_cmd", "print a pool credential scoped to one kvNamespace"),
}


class _Command(Protocol):
    def add_arguments(self, parser: argparse.ArgumentParser) -> None: ...

    def run(self, args: argparse.Namespace) -> int: ...


def _load(name: str) -> _Command | None:
    module_name, _ = SUBCOMMANDS[name]
    try:
        return cast(_Command, importlib.import_module(module_name))
    except ModuleNotFoundError as exc:
        if exc.name and module_name.startswith(exc.name):
            return None  # sub-command not part of this build yet
        raise


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="daybreak", description=__doc__.splitlines()[0] if __doc__ else None)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    chosen = argv[0] if argv and argv[0] in SUBCOMMANDS else None
    for name, (_, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text)
        if name == chosen:
            command = _load(name)
            if command is None:
                parser.error(f"sub-command {name!r} is not available in this build")
            command.add_arguments(p)
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    command = _load(args.command)
    assert command is not None
    return command.run(args)


if __name__ == "__main__":
    sys.exit(main())
