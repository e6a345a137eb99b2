"""Pairing two bench runs request by request: one configuration before and after a change.

Two runs of the same plan (seeds, prompt count, workload, scored window) sent the same request
stream at every rate they share (arrivals.py), so request k of seed s is the same request in both.
`pair` sets one configuration of run A against one of run B on those requests: attainment per
shared rate and SLO, B minus A with the paired block-bootstrap interval of comparison.py (the
same blocks drawn on both sides), each SLO's goodput on both sides with the interval of their
difference, the median TTFT and ITL with the interval of their difference, and TTFT percentiles. Use it for what one run cannot hold: the
same configuration on two versions of the code, or of vLLM. The runs are not interleaved, so
drift of the machine between them lands on one side: run them minutes apart on one machine, and
compare calibrations (report.md) before trusting a difference.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from pdserve.bench.comparison import blocks, num_met
from pdserve.bench.goodput import Goodput, goodput
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
class PairedGoodput:
    goodput: tuple[Goodput, Goodput]  # A's, B's
    difference: Interval  # B's value minus A's, paired


@dataclass(frozen=True)
class PairedMedian:
    median: tuple[float, float]  # A's, B's (ms)
    difference: Interval  # B minus A (ms), paired


@dataclass(frozen=True)
class Pairing:
    a: Side
    b: Side
    num_scored: int  # scored requests per rate, over the seeds
    by_slo: dict[str, list[PairedRate]]
    ttft_ms: dict[float, tuple[tuple[float, ...], tuple[float, ...]]]  # rate -> A's, B's percentiles
    goodput: dict[str, PairedGoodput] = field(default_factory=dict)  # SLO name ->
    # rate -> {"TTFT": ..., "ITL": ...}: median TTFT of the scored successful requests, median of their ITL gaps
    medians: dict[float, dict[str, PairedMedian]] = field(default_factory=dict)
    target: float = 0.9  # attainment a rate needs to count for goodput (A's plan's)

    def resolved(self) -> list[str]:
        """Every difference whose interval excludes 0, named; empty when none is told apart."""
        out = [f"{name} attainment at {c.rate:g} req/s" for name, cells in self.by_slo.items() for c in cells
               if _excludes_zero(c.difference)]
        out += [f"{name} goodput" for name, g in self.goodput.items() if _excludes_zero(g.difference)]
        out += [f"median {metric} at {rate:g} req/s" for rate, by in self.medians.items()
                for metric, m in by.items() if _excludes_zero(m.difference)]
        return out


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
    by_slo, goodputs = {}, {}
    for slo in slos or plan_a.slos:
        met_a = _met(runs_a, rates, cut, slo)
        met_b = _met(runs_b, rates, cut, slo)

        def difference(idx: np.ndarray, met_a=met_a, met_b=met_b) -> np.ndarray:
            return (met_b[:, idx].sum(axis=1) - met_a[:, idx].sum(axis=1)) / sizes[idx].sum()

        def goodput_difference(idx: np.ndarray, met_a=met_a, met_b=met_b) -> np.ndarray:
            total = sizes[idx].sum()
            g_a = goodput(rates, list(met_a[:, idx].sum(axis=1) / total), plan_a.target)
            g_b = goodput(rates, list(met_b[:, idx].sum(axis=1) / total), plan_a.target)
            return np.array([g_b.value - g_a.value])

        intervals = bootstrap_blocks(len(cut), difference)
        total = sizes.sum()
        by_slo[slo.name] = [PairedRate(r, (met_a[i].sum() / total, met_b[i].sum() / total), intervals[i])
                            for i, r in enumerate(rates)]
        whole = (goodput(rates, list(met_a.sum(axis=1) / total), plan_a.target),
                 goodput(rates, list(met_b.sum(axis=1) / total), plan_a.target))
        goodputs[slo.name] = PairedGoodput(whole, bootstrap_blocks(len(cut), goodput_difference)[0])
    ttft = {r: (_ttft(runs_a, r, cut), _ttft(runs_b, r, cut)) for r in rates}
    medians = {r: {metric: _paired_median(_per_block(runs_a, r, cut, values), _per_block(runs_b, r, cut, values))
                   for metric, values in (("TTFT", _ttft_values), ("ITL", _itl_values))}
               for r in rates}
    return Pairing(a, b, int(sizes.sum()), by_slo, ttft, goodputs, medians, plan_a.target)


def _excludes_zero(interval: Interval) -> bool:
    return interval.low > 0 or interval.high < 0


def _ttft_values(record) -> tuple[float, ...]:
    return (record.ttft_ms,)


def _itl_values(record) -> tuple[float, ...]:
    return record.itl_ms


def _per_block(runs: dict, rate: float, cut, values) -> list[np.ndarray]:
    """Per block of scored requests, the values of its successful requests (as the report's latency table)."""
    return [np.array([v for i in positions if not runs[(rate, seed)].records[i].failed
                      for v in values(runs[(rate, seed)].records[i])], dtype=float)
            for seed, positions in cut]


def _median(per_block: list[np.ndarray], idx) -> float:
    values = np.concatenate([per_block[i] for i in idx])
    return float(np.median(values)) if values.size else float("nan")


def _paired_median(a: list[np.ndarray], b: list[np.ndarray]) -> PairedMedian:
    """Medians of A and B over all blocks; the interval of B minus A over the same resampled blocks."""
    every = range(len(a))

    def difference(idx: np.ndarray) -> np.ndarray:
        return np.array([_median(b, idx) - _median(a, idx)])

    return PairedMedian((_median(a, every), _median(b, every)), bootstrap_blocks(len(a), difference)[0])


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
    if pairing.goodput:
        lines += ["", f"| goodput (req/s, ≥ {pairing.target:g} attainment) | A | B | B - A |", "|---|---|---|---|"]
        lines += [f"| {name} | {g.goodput[0]} | {g.goodput[1]} | {g.goodput[1].value - g.goodput[0].value:+.2f} "
                  f"{g.difference} |" for name, g in pairing.goodput.items()]
    if pairing.medians:
        lines += ["", "| median (ms): A / B, B - A | " + " | ".join(f"{r:g} req/s" for r in rates) + " |",
                  "|---|" + "---|" * len(rates)]
        for metric in ("TTFT", "ITL"):
            lines.append(f"| {metric} | " + " | ".join(
                f"{m.median[0]:.1f} / {m.median[1]:.1f}, {m.median[1] - m.median[0]:+.1f} {m.difference}"
                for m in (pairing.medians[r][metric] for r in rates)) + " |")
    head = "/".join(f"p{q}" for q in TTFT_PERCENTILES)
    lines += ["", f"| TTFT {head} (ms) | " + " | ".join(f"{r:g} req/s" for r in rates) + " |",
              "|---|" + "---|" * len(rates)]
    for side, label in ((0, a), (1, b)):
        lines.append(f"| {label} | " + " | ".join("/".join(f"{v:.0f}" for v in pairing.ttft_ms[r][side]) or "—"
                                                 for r in rates) + " |")
    told_apart = pairing.resolved()
    lines += ["", ("Told apart (interval excludes 0): " + "; ".join(told_apart) + ".") if told_apart
              else "No difference told apart: every interval of B minus A contains 0."]
    return "\n".join(lines) + "\n"
