"""Pairing two bench runs request by request: one configuration before and after a change.

Two runs of the same plan (seeds, prompt count, workload, scored window) sent the same request
stream at every rate they share (arrivals.py), so request k of seed s is the same request in both.
`pair` sets one configuration of run A against one of run B on those requests: attainment per
shared rate and SLO, B minus A with the paired block-bootstrap interval of comparison.py (the
same blocks drawn on both sides), and TTFT percentiles. Use it for what one run cannot hold: the
same configuration on two versions of the code, or of vLLM. The runs are not interleaved, so
drift of the machine between them lands on one side: run them minutes apart on one machine, and
compare calibrations (report.md) before trusting a difference.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pdserve.bench.comparison import blocks, num_met
from pdserve.bench.plan import BenchPlan
from pdserve.bench.records import BenchRun
from pdserve.bench.results import ResultsDir
from pdserve.bench.stats import Interval, bootstrap_blocks
from pdserve.errors import ConfigError
from pdserve.slo import SLO

TTFT_PERCENTILES = (10, 50, 90)


@dataclass(frozen=True)
class Side:
    """One configuration of one run: ``DIR:CONFIG`` or ``DIR:CONFIG=LABEL``."""

    directory: Path
    config: str
    label: str

    @classmethod
    def parse(cls, text: str) -> "Side":
        directory, sep, rest = text.rpartition(":")
        config, _, label = rest.partition("=")
        if not sep or not directory or not config.strip():
            raise ConfigError(f"{text!r} is not DIR:CONFIG or DIR:CONFIG=LABEL (e.g. runs/bench-default-20261205-140000:adaptive=before)")
        return cls(Path(directory), config.strip(), label.strip() or f"{Path(directory).name}:{config.strip()}")


@dataclass(frozen=True)
class PairedRate:
    rate: float
    attainment: tuple[float, float]  # A's, B's
    difference: Interval  # B minus A, paired


@dataclass(frozen=True)
class Pairing:
    a: Side
    b: Side
    num_scored: int  # scored requests per rate, over the seeds
    by_slo: dict[str, list[PairedRate]]
    ttft_ms: dict[float, tuple[tuple[float, ...], tuple[float, ...]]]  # rate -> A's, B's percentiles


def load_side(side: Side) -> tuple[BenchPlan, dict[tuple[float, int], BenchRun]]:
    results = ResultsDir(side.directory)
    if not results.plan_path.exists():
        raise ConfigError(f"{side.directory}: no plan.json (not a bench results directory)")
    plan = BenchPlan.load(results.plan_path)
    if plan.calibrated:
        calibration = results.calibration()
        if calibration is None:
            raise ConfigError(f"{side.directory}: its rates were never placed (no calibration.json)")
        plan = plan.resolved(calibration.capacity)
    if side.config not in plan.configs:
        raise ConfigError(f"{side.directory}: no configuration {side.config!r} (it has {', '.join(plan.configs)})")
    runs = {(p.rate, p.seed): run for p, run in results.load(plan).items() if p.config == side.config}
    return plan, runs


def same_streams(a: BenchPlan, b: BenchPlan) -> None:
    """ConfigError unless the two plans sent the same requests and scored the same ones."""
    for name in ("seeds", "workload", "warmup_fraction", "cooldown_fraction", "model"):
        if getattr(a, name) != getattr(b, name):
            raise ConfigError(f"the runs differ in {name} ({getattr(a, name)} against {getattr(b, name)}): "
                              "they did not send the same requests")


def pair(a: Side, b: Side, slos: tuple[SLO, ...] = ()) -> Pairing:
    """A's and B's configuration on the requests both runs sent, at every rate both measured in
    full; under `slos`, else A's plan's SLOs."""
    plan_a, runs_a = load_side(a)
    plan_b, runs_b = load_side(b)
    same_streams(plan_a, plan_b)
    seeds = plan_a.seeds
    rates = sorted(r for r in set(plan_a.rates) & set(plan_b.rates)
                   if all((r, s) in runs_a and (r, s) in runs_b for s in seeds))
    if not rates:
        raise ConfigError(f"{a.label} and {b.label} have no rate measured for every seed in both runs")
    cut = blocks(plan_a)
    if len(cut) < 2:
        raise ConfigError("fewer than 2 blocks of scored requests: nothing to resample")
    sizes = np.array([len(positions) for _, positions in cut], dtype=float)
    by_slo = {}
    for slo in slos or plan_a.slos:
        met_a = _met(runs_a, rates, cut, slo)
        met_b = _met(runs_b, rates, cut, slo)

        def difference(idx: np.ndarray, met_a=met_a, met_b=met_b) -> np.ndarray:
            return (met_b[:, idx].sum(axis=1) - met_a[:, idx].sum(axis=1)) / sizes[idx].sum()

        intervals = bootstrap_blocks(len(cut), difference)
        total = sizes.sum()
        by_slo[slo.name] = [PairedRate(r, (met_a[i].sum() / total, met_b[i].sum() / total), intervals[i])
                            for i, r in enumerate(rates)]
    ttft = {r: (_ttft(runs_a, r, cut), _ttft(runs_b, r, cut)) for r in rates}
    return Pairing(a, b, int(sizes.sum()), by_slo, ttft)


def _met(runs: dict, rates: list[float], cut, slo: SLO) -> np.ndarray:
    return np.array([[num_met(runs[(r, seed)], positions, slo) for seed, positions in cut] for r in rates],
                    dtype=float)


def _ttft(runs: dict, rate: float, cut) -> tuple[float, ...]:
    records = [runs[(rate, seed)].records[i] for seed, positions in cut for i in positions]
    values = [r.ttft_ms for r in records if not r.failed]  # as the report's latency table: successful ones
    return tuple(float(np.percentile(values, q)) for q in TTFT_PERCENTILES) if values else ()


def render(pairing: Pairing) -> str:
    a, b = pairing.a.label, pairing.b.label
    rates = sorted(pairing.ttft_ms)
    lines = [f"# {b} against {a}, request by request", "",
             f"- A: `{pairing.a.directory}` configuration `{pairing.a.config}`; "
             f"B: `{pairing.b.directory}` configuration `{pairing.b.config}`.",
             f"- {pairing.num_scored} scored requests per rate, the same in both runs; B minus A with its paired "
             "block-bootstrap 95 % interval. The runs were not interleaved: drift between them is in the difference.",
             "", "| SLO | " + " | ".join(f"{r:g} req/s: A / B, B - A" for r in rates) + " |",
             "|---|" + "---|" * len(rates)]
    for name, cells in pairing.by_slo.items():
        lines.append(f"| {name} | " + " | ".join(
            f"{c.attainment[0]:.2f} / {c.attainment[1]:.2f}, {c.attainment[1] - c.attainment[0]:+.2f} {c.difference}"
            for c in cells) + " |")
    head = "/".join(f"p{q}" for q in TTFT_PERCENTILES)
    lines += ["", f"| TTFT {head} (ms) | " + " | ".join(f"{r:g} req/s" for r in rates) + " |",
              "|---|" + "---|" * len(rates)]
    for side, label in ((0, a), (1, b)):
        lines.append(f"| {label} | " + " | ".join("/".join(f"{v:.0f}" for v in pairing.ttft_ms[r][side]) or "—"
                                                 for r in rates) + " |")
    return "\n".join(lines) + "\n"
