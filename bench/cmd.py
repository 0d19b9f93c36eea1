"""``daybreak bench``: run one benchmark suite or all of them.

Each suite lives in its own module of ``daybreak.bench`` with
``add_arguments(parser)`` and ``run(args) -> int``, and prints its anchors'
numbers from the same run next to ours.
"""

from __future__ import annotations

import argparse
import importlib
from typing import Any

# suite -> module
SUITES: dict[str, str] = {
    "transfer": "daybreak.bench.transfer",
    "store": "daybreak.bench.store",
    "operator": "daybreak.bench.operator",
    "serving": "daybreak.bench.serving",
    "vllm": "daybreak.bench.vllm",
    "elastic": "daybreak.bench.elastic",
}


def _module(name: str) -> Any:
    try:
        return importlib.import_module(SUITES[name])
    except ModuleNotFoundError as exc:
        if exc.name == SUITES[name]:
            return None
        raise


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="suite", metavar="SUITE", required=True)
    sub.add_parser("all", help="every suite in turn, with its defaults")
    for name in SUITES:
        module = _module(name)
        if module is not None:
            module.add_arguments(sub.add_parser(name, help=(module.__doc__ or name).splitlines()[0]))


def run(args: argparse.Namespace) -> int:
    if args.suite != "all":
        return int(_module(args.suite).run(args))
    status = 0
    for name in SUITES:
        module = _module(name)
        if module is None:
            continue
        parser = argparse.ArgumentParser()
        module.add_arguments(parser)
        print(f"\n##### bench {name}", flush=True)
        status |= int(module.run(parser.parse_args([])))
    return status
