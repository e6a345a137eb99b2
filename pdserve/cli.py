"""The `pdserve` command: argparse subcommands that dispatch to the package's modules.

Each subcommand module exposes `add_parser(subparsers)`, which registers a parser whose
`func(args) -> int` runs it. Optional modules (bench) are added when they import.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from pdserve.errors import PDServeError

SUBCOMMAND_MODULES = ("pdserve.model.cli", "pdserve.launch.cli", "pdserve.launch.per_host_cli", "pdserve.bench.cli",
                       "pdserve.bench.pair_cli")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description="Prefill/decode disaggregation for vLLM")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in SUBCOMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name != name:  # the module exists but a dependency of it is missing
                raise
            continue
        module.add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except PDServeError as exc:
        print(f"pdserve: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
