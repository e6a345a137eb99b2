"""Goodput confidence intervals and paired comparisons between configurations (block bootstrap).

Every configuration received the same request stream at every rate (arrivals.py), so request k
of seed s is the same request everywhere. The scored window of each seed is cut into blocks of
``BLOCK_REQUESTS`` consecutive requests; one bootstrap resample draws blocks with replacement and
recomputes, from the drawn blocks only, every configuration's attainment curve, its goodput and
every goodput ratio, and every difference of attainment at one rate. Drawing the same blocks for
all configurations pairs the comparison: the noise of the stream itself (a burst of arrivals)
cancels in the ratio and in the difference. The difference still compares configurations where
their goodputs cannot (all of them below the lowest rate, or above the highest).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from pdserve.bench.attainment import Verdict, judge
from pdserve.bench.goodput import goodput, ratio
from pdserve.bench.plan import BenchPlan, Point
from pdserve.bench.records import BenchRun
from pdserve.bench.stats import Interval, bootstrap_blocks
from pdserve.bench.summary import window
from pdserve.slo import SLO

BLOCK_REQUESTS = 8


@dataclass(frozen=True)
class Comparison:
    """Bootstrap 95 % intervals of one SLO's goodputs and goodput ratios (numerator, denominator)."""

    slo: SLO
    goodput_ci: dict[str, Interval]
    ratio_ci: dict[tuple[str, str], Interval]
    num_blocks: int
    # (a, b, rate) -> attainment of a minus attainment of b at that rate, on the same requests
    difference_ci: dict[tuple[str, str, float], Interval] = field(default_factory=dict)


def blocks(plan: BenchPlan) -> list[tuple[int, range]]:
    """(seed, positions) of every block of the scored windows."""
    out = []
    for seed in plan.seeds:
        w = window(plan, seed)
        out += [(seed, w[i:i + BLOCK_REQUESTS]) for i in range(0, len(w), BLOCK_REQUESTS)]
    return out


def complete(plan: BenchPlan, runs: dict[Point, BenchRun], config: str) -> bool:
    return all(p in runs for p in plan.points() if p.config == config)


def compare(plan: BenchPlan, runs: dict[Point, BenchRun], slo: SLO) -> Comparison | None:
    """None unless some configuration has every point measured and there are >= 2 blocks."""
    configs = [c for c in plan.configs if complete(plan, runs, c)]
    cut = blocks(plan)
    if not configs or len(cut) < 2:
        return None
    rates = sorted(plan.rates)
    sizes = np.array([len(b) for _, b in cut], dtype=float)
    met = {c: np.array([[num_met(runs[Point(c, r, seed)], positions, slo) for seed, positions in cut] for r in rates])
           for c in configs}
    pairs = [(a, b) for a in configs for b in configs if a != b]

    differences = [(a, b, r) for a, b in pairs for r in rates]

    def statistic(idx: np.ndarray) -> np.ndarray:
        total = sizes[idx].sum()
        att = {c: met[c][:, idx].sum(axis=1) / total for c in configs}
        g = {c: goodput(rates, list(att[c]), plan.target) for c in configs}
        return np.array([g[c].value for c in configs] + [ratio(g[a], g[b]).value for a, b in pairs]
                        + [att[a][rates.index(r)] - att[b][rates.index(r)] for a, b, r in differences])

    intervals = bootstrap_blocks(len(cut), statistic)
    n, m = len(configs), len(pairs)
    return Comparison(slo, dict(zip(configs, intervals)), dict(zip(pairs, intervals[n:n + m])), len(cut),
                      dict(zip(differences, intervals[n + m:])))


def num_met(run: BenchRun, positions: range, slo: SLO) -> int:
    """How many of the requests at `positions` of `run` met `slo`."""
    return sum(judge(run.records[i], slo) is Verdict.MET for i in positions)
