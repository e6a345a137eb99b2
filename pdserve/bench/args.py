"""`pdserve bench`'s flag values, each checked where argparse reads it.

Every converter raises ``argparse.ArgumentTypeError`` naming the rule and the value, so a bad
value ends the command with ``pdserve bench: error: --flag: <rule> (got '<value>')`` and exit 2
before anything is written. The types every command shares are in pdserve.launch.arguments.
Rules between flags (a declared SLO the plan lacks, warm-up and cool-down that leave no window)
are in ``check_together``. Light at import: no vLLM, torch or numpy.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from pdserve.bench.budget import TWO_HOST_SUFFIX, Budget, base_config, declared_slo
from pdserve.bench.plan import KNOWN_CONFIGS, BenchPlan
from pdserve.errors import ConfigError
from pdserve.launch.arguments import token_count
from pdserve.slo import SLO

MODEL_SIZES = ("tiny", "small")
MODEL_FILES = ("config.json", "tokenizer.json")
PORTS_PER_DEPLOYMENT = 10  # BENCH_PORT and the next 9
HIGHEST_PORT = 65535 - (PORTS_PER_DEPLOYMENT - 1)


def strings(text: str) -> tuple[str, ...]:
    """A comma list, blanks dropped."""
    return tuple(s.strip() for s in text.split(",") if s.strip())


def positive_float(text: str) -> float:
    return _number(text, float, lambda v: v > 0, "a number > 0")


def fraction(text: str) -> float:
    """A share of the arrival span left out of scoring."""
    return _number(text, float, lambda v: 0 <= v < 0.9, "a share in [0, 0.9)")


def target(text: str) -> float:
    return _number(text, float, lambda v: 0 < v <= 1, "an attainment in (0, 1]")


def port(text: str) -> int:
    return _number(text, int, lambda v: 1 <= v <= HIGHEST_PORT,
                   f"a port in 1..{HIGHEST_PORT} (a deployment uses it and the next {PORTS_PER_DEPLOYMENT - 1})")


def rates(text: str) -> tuple[float, ...]:
    """Distinct positive request rates (req/s), or fractions of the calibrated capacity."""
    return _distinct(tuple(_number(s, float, lambda v: v > 0, "a comma list of numbers > 0", text)
                           for s in _items(text)), text)


def seeds(text: str) -> tuple[int, ...]:
    return _distinct(tuple(_number(s, int, lambda v: True, "a comma list of whole numbers", text)
                           for s in _items(text)), text)


def budgets(text: str) -> tuple[str, ...]:
    """Token budgets for `chunked` (--chunk-candidates): a comma list of token counts."""
    return tuple(str(token_count(s)) for s in _items(text))


def configs(text: str) -> tuple[str, ...]:
    names = _items(text)
    unknown = [c for c in names if base_config(c) not in KNOWN_CONFIGS]
    if unknown:
        raise _rule(f"configurations from {', '.join(KNOWN_CONFIGS)}, and adaptive@SLO_NAME; "
                    f"unknown: {', '.join(unknown)}", text)
    return _distinct(names, text)


def slo(text: str) -> SLO:
    try:
        return SLO.parse(text)
    except ConfigError as exc:
        raise _rule(f"an SLO such as blog:ttft<1000,mean_itl<50 ({exc})", text) from None


def tune(text: str) -> tuple[str, tuple[str, ...]]:
    """``CONFIG=BUDGET,...`` (``CONFIG=`` alone: not tuned), each budget checked against CONFIG."""
    config, sep, specs = text.partition("=")
    config = config.strip()
    if not sep or base_config(config) not in KNOWN_CONFIGS:
        raise _rule("CONFIG=BUDGET,... with a known CONFIG, e.g. write=default,512 or adaptive=512+serve", text)
    try:
        for spec in strings(specs):
            Budget.parse(spec).check(config.removesuffix(TWO_HOST_SUFFIX))
    except ConfigError as exc:
        raise _rule(f"budgets CONFIG can run ({exc})", text) from None
    return config, strings(specs)


def model(text: str) -> str:
    """A built-in size, or a directory holding a model and its tokenizer (the bench builds its prompts
    with it)."""
    if text in MODEL_SIZES:
        return text
    path = Path(text)
    rule = f"{' or '.join(MODEL_SIZES)}, or a model directory with {' and '.join(MODEL_FILES)}"
    if not path.is_dir() or not all((path / f).is_file() for f in MODEL_FILES):
        raise _rule(rule, text)
    return str(path.resolve())


def check_together(args: argparse.Namespace, base: BenchPlan) -> str | None:
    """The first rule two or more flags break together, as ``--flag: rule``; None if they agree.
    ``base``: the preset the flags override."""
    slo_names = [s.name for s in args.slo or base.slos]
    for config in args.configs or ():
        name = declared_slo(config)
        if name is not None and name not in slo_names:
            return f"--configs: {config} declares SLO {name!r}, none of the plan's ({', '.join(slo_names)}; see --slo)"
    if args.tune_slo is not None and args.tune_slo not in slo_names:
        return f"--tune-slo: {args.tune_slo!r} is none of the plan's SLOs ({', '.join(slo_names)})"
    warmup = base.warmup_fraction if args.warmup_fraction is None else args.warmup_fraction
    cooldown = base.cooldown_fraction if args.cooldown_fraction is None else args.cooldown_fraction
    if warmup + cooldown >= 0.9:
        return (f"--warmup-fraction {warmup:g} and --cooldown-fraction {cooldown:g} leave no scored window "
                f"(their sum must be below 0.9)")
    return None


def _rule(rule: str, text: str) -> argparse.ArgumentTypeError:
    return argparse.ArgumentTypeError(f"{rule} (got {text!r})")


def _items(text: str) -> tuple[str, ...]:
    items = strings(text)
    if not items:
        raise _rule("a comma list with at least one item", text)
    return items


def _distinct(values: tuple, text: str) -> tuple:
    if len(set(values)) != len(values):
        raise _rule("a list without repeated values", text)
    return values


def _number(text: str, kind: type, valid, rule: str, shown: str | None = None):
    """``kind(text)`` if it parses and is ``valid``; else the rule, showing ``shown`` (the whole flag value)."""
    try:
        value = kind(text)
    except ValueError:
        raise _rule(rule, shown or text) from None
    if not valid(value):
        raise _rule(rule, shown or text)
    return value
