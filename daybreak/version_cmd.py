"""``daybreak version``: print the release and the pinned tool versions."""

from __future__ import annotations

import argparse

from daybreak.devenv import versions
from daybreak.version import __version__


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tools", action="store_true", help="also print the pinned control-plane versions")


def run(args: argparse.Namespace) -> int:
    print(f"daybreak {__version__}")
    if args.tools:
        for tool in versions.TOOLS.values():
            print(f"  {tool.name} {tool.version}")
    return 0
