"""`pdserve make-model DIR --size tiny|small [--seed N]`."""

from __future__ import annotations

import argparse
import time

from pdserve.model.build import DEFAULT_SEED, make_model
from pdserve.model.spec import SIZES


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("make-model", help="build a random-weight Llama model (config, tokenizer, weights)")
    p.add_argument("dir", help="output directory (must not exist or be empty)")
    p.add_argument("--size", required=True, help=f"one of {', '.join(SIZES)}")
    p.add_argument("--seed", type=int, default=DEFAULT_SEED, help="weight seed; same seed -> identical files")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    start = time.monotonic()
    out = make_model(args.dir, args.size, args.seed)
    print(f"built {args.size} model in {out} ({time.monotonic() - start:.1f} s)")
    return 0
