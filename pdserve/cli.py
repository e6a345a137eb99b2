"""The `pdserve` command: argparse subcommands that dispatch to the package's modules.

Each subcommand module exposes `add_parser(subparsers)`, which registers its parsers; each parser's
`func(args) -> int` runs the command. These modules stay light to import (no torch, vLLM or zmq):
a command's runner imports the heavy part when it runs. `pdserve COMMAND ...` imports only that
command's module, so its `--help` answers at once whatever the other modules import.

Bad input is refused before anything starts: by the parser (argument types in
pdserve.launch.arguments) or by a runner raising ConfigError, as one line
`pdserve COMMAND: error: --flag: rule (got value)`, exit status 2.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

import pdserve
from pdserve.errors import AddressInUseError, ConfigError, PDServeError
from pdserve.launch.arguments import CommandParser, output_directory
from pdserve.paths import WORK_DIR_VARIABLES

COMMAND_MODULES = {  # command -> the module whose add_parser registers it
    "up": "pdserve.launch.cli", "demo": "pdserve.launch.cli",
    "instance": "pdserve.launch.per_host_cli", "router": "pdserve.launch.per_host_cli",
    "make-model": "pdserve.model.cli", "bench": "pdserve.bench.cli", "bench-pair": "pdserve.bench.pair_cli",
}
USAGE_ERROR = 2


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The whole command line, or only `command`'s subcommand module when one is named."""
    parser = CommandParser(prog="pdserve", description="Prefill/decode disaggregation for vLLM")
    parser.add_argument("--version", action="version", version=f"pdserve {pdserve.__version__}")
    parser.add_argument("--work-dir", type=output_directory, metavar="DIR",
                        help="where models/, .cache/ and runs/ live (default: $PDSERVE_WORK_DIR, else the source "
                             "checkout pdserve runs from, else ~/.cache/pdserve)")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    modules = [COMMAND_MODULES[command]] if command in COMMAND_MODULES else COMMAND_MODULES.values()
    for name in dict.fromkeys(modules):
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name != name:  # the module exists but a dependency of it is missing
                raise
            continue
        module.add_parser(subparsers)
    return parser


def command_of(argv: list[str]) -> str | None:
    """The subcommand `argv` names (the first word that is not a global option or its value)."""
    words = iter(argv)
    for word in words:
        if word == "--work-dir":
            next(words, None)
        elif not word.startswith("-"):
            return word
    return None


def parse_args(argv: list[str]) -> argparse.Namespace:
    """Parse `argv`; a command's `--config FILE` supplies defaults that its flags override."""
    parser = build_parser(command_of(argv))
    args = parser.parse_args(argv)
    if getattr(args, "config", None) is not None:
        subparser = next(a for a in parser._actions if a.dest == "command").choices[args.command]
        args.apply_config(subparser, args.config)
        args = parser.parse_args(argv)
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.work_dir is not None:  # for this process and every process it starts
        os.environ[WORK_DIR_VARIABLES[0]] = str(args.work_dir)
    try:
        return args.func(args)
    except AddressInUseError as exc:  # the machine's state, not the input: a run error
        print(f"pdserve: error: {exc}", file=sys.stderr)
        return 1
    except ConfigError as exc:
        print(f"pdserve {args.command}: error: {exc}", file=sys.stderr)
        return USAGE_ERROR
    except PDServeError as exc:
        print(f"pdserve: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
