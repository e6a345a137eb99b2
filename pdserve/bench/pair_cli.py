"""`pdserve bench-pair A_DIR:CONFIG B_DIR:CONFIG`: one configuration of two bench runs, request by
request (pairing.py), printed as markdown (and written to --out)."""

from __future__ import annotations

import argparse
from pathlib import Path

from pdserve.bench import args as check
from pdserve.errors import ConfigError


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "bench-pair", help="set one configuration of two bench runs against each other, request by request",
        description="Attainment per shared rate and SLO, goodput per SLO, and median TTFT and ITL of A's and B's configuration on the same requests, B minus "
                    "A with a paired block-bootstrap interval, and TTFT percentiles. Both runs must come from the "
                    "same plan (seeds, prompts, workload, scored window), e.g. before and after a change.",
        epilog="example: pdserve bench-pair runs/before:adaptive=before runs/after:adaptive=after")
    p.add_argument("a", metavar="A_DIR:CONFIG[=LABEL]", help="the baseline run and configuration")
    p.add_argument("b", metavar="B_DIR:CONFIG[=LABEL]", help="the run and configuration set against it")
    p.add_argument("--slo", action="append", metavar="NAME:SPEC", type=check.slo,
                   help="judge under this SLO instead of A's plan's (repeatable), e.g. 'blog:ttft<1000,mean_itl<50'")
    p.add_argument("--out", type=Path, help="also write the markdown here")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from pdserve.bench.pairing import Side, pair, render  # lazy: scipy, loaded only when the command runs

    if args.out is not None and args.out.is_dir():
        raise ConfigError(f"--out: {args.out} is a directory (give a file)")
    # both runs are read and checked against each other (ConfigError: exit 2) before anything is written
    text = render(pair(Side.parse(args.a), Side.parse(args.b), tuple(args.slo or ())))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    print(text, end="")
    return 0
