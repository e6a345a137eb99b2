"""`pdserve make-model DIR --size tiny|small [--arch ARCH] [--seed N]`.

Light to import: the architectures are listed without torch, which `run` loads when it builds.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from pdserve.model.archs import ARCHS, DEFAULT_ARCH, arch_for
from pdserve.model.spec import DEFAULT_SEED, MAX_SEED


def _rule(rule: str, text: str) -> argparse.ArgumentTypeError:
    return argparse.ArgumentTypeError(f"{rule} (got {text!r})")


def empty_directory(text: str) -> Path:
    """A directory to create, or an empty one."""
    path = Path(text).expanduser()
    if path.exists() and not path.is_dir():
        raise _rule("a new or empty directory (this path is a file)", text)
    if path.is_dir() and any(path.iterdir()):
        raise _rule("a new or empty directory (this one holds files)", text)
    return path


def seed(text: str) -> int:
    rule = f"a whole number in 0..{MAX_SEED}"
    try:
        value = int(text)
    except ValueError:
        raise _rule(rule, text) from None
    if not 0 <= value <= MAX_SEED:
        raise _rule(rule, text)
    return value


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("make-model", help="build a random-weight model (config, tokenizer, weights)")
    p.add_argument("dir", type=empty_directory, help="output directory (must not exist or be empty)")
    p.add_argument("--size", required=True, choices=list(dict.fromkeys(s for a in ARCHS.values() for s in a.sizes)),
                   help="llama builds tiny and small; the other architectures tiny")
    p.add_argument("--arch", default=DEFAULT_ARCH, choices=list(ARCHS), help="model family")
    p.add_argument("--seed", type=seed, default=DEFAULT_SEED, help="weight seed (default 0); same seed -> identical files")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    arch_for(args.arch).spec_for(args.size)  # refuses a size the family does not build, before torch loads
    from pdserve.model.build import make_model  # lazy: torch, loaded once the arguments are checked

    start = time.monotonic()
    out = make_model(args.dir, args.size, args.seed, args.arch)
    print(f"built {args.arch} {args.size} model in {out} ({time.monotonic() - start:.1f} s)")
    return 0
