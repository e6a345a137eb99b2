"""Per-configuration, per-rate, per-SLO numbers derived from the measured points."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from pdserve.bench.attainment import Attainment, Verdict, attainment
from pdserve.bench.goodput import Goodput, goodput
from pdserve.bench.plan import BenchPlan, Point
from pdserve.bench.records import BenchRun, RequestRecord
from pdserve.bench.slo import SLO
from pdserve.bench.stats import MeanCI, mean_ci95, percentile


@dataclass(frozen=True)
class RateResult:
    """One configuration at one rate against one SLO, over the seeds measured there."""

    rate: float
    per_seed: tuple[Attainment, ...]
    attainment: MeanCI  # mean fraction over seeds with its 95 % CI

    @property
    def num_requests(self) -> int:
        return sum(a.num_requests for a in self.per_seed)

    @property
    def num_met(self) -> int:
        return sum(a.num_met for a in self.per_seed)

    @property
    def misses(self) -> dict[Verdict, int]:
        total: Counter[Verdict] = Counter()
        for a in self.per_seed:
            total.update(a.misses)
        return dict(total)

    @property
    def main_miss_cause(self) -> Verdict | None:
        return Attainment(self.num_requests, self.num_met, self.misses).main_miss_cause


@dataclass(frozen=True)
class Curve:
    """Attainment against rate for one configuration and SLO, and the goodput it implies."""

    config: str
    slo: SLO
    rates: tuple[RateResult, ...]
    goodput: Goodput  # of the seed-mean curve
    seed_goodputs: tuple[Goodput, ...]  # the same computed on each seed's own curve

    def at(self, rate: float) -> RateResult | None:
        return next((r for r in self.rates if r.rate == rate), None)


@dataclass(frozen=True)
class Latency:
    """Pooled per-request latency percentiles (ms) of one configuration at one rate."""

    num_requests: int
    num_failed: int
    ttft_p50: float
    ttft_p90: float
    mean_itl_p50: float
    mean_itl_p90: float
    max_gap_p50: float
    max_gap_p90: float
    request_throughput: float  # mean over seeds, req/s
    output_throughput: float  # mean over seeds, tok/s


def curve(plan: BenchPlan, runs: dict[Point, BenchRun], config: str, slo: SLO) -> Curve | None:
    """The curve over the rates measured so far; None when the configuration has no points yet."""
    results = []
    for rate in sorted(plan.rates):
        per_seed = tuple(
            attainment(runs[p].records, slo)
            for p in (Point(config, rate, s) for s in plan.seeds)
            if p in runs
        )
        if per_seed:
            results.append(RateResult(rate, per_seed, mean_ci95([a.fraction for a in per_seed])))
    if not results:
        return None
    rates = [r.rate for r in results]
    mean_curve = goodput(rates, [r.attainment.mean for r in results], plan.target)
    seed_curves = []
    for seed in plan.seeds:
        pts = [(rate, attainment(runs[Point(config, rate, seed)].records, slo).fraction)
               for rate in rates if Point(config, rate, seed) in runs]
        if pts:
            seed_curves.append(goodput([r for r, _ in pts], [a for _, a in pts], plan.target))
    return Curve(config, slo, tuple(results), mean_curve, tuple(seed_curves))


def records_at(plan: BenchPlan, runs: dict[Point, BenchRun], config: str, rate: float) -> list[RequestRecord]:
    """All requests of ``config`` at ``rate``, pooled over seeds."""
    return [r for s in plan.seeds if (p := Point(config, rate, s)) in runs for r in runs[p].records]


def latency(plan: BenchPlan, runs: dict[Point, BenchRun], config: str, rate: float) -> Latency | None:
    seed_runs = [runs[p] for s in plan.seeds if (p := Point(config, rate, s)) in runs]
    if not seed_runs:
        return None
    records = [r for run in seed_runs for r in run.records]
    ok = [r for r in records if not r.failed]
    ttft = [r.ttft_ms for r in ok]
    mean_itl = [r.mean_itl_ms for r in ok]
    max_gap = [r.max_gap_ms for r in ok]
    n = len(seed_runs)
    return Latency(
        num_requests=len(records),
        num_failed=len(records) - len(ok),
        ttft_p50=percentile(ttft, 50), ttft_p90=percentile(ttft, 90),
        mean_itl_p50=percentile(mean_itl, 50), mean_itl_p90=percentile(mean_itl, 90),
        max_gap_p50=percentile(max_gap, 50), max_gap_p90=percentile(max_gap, 90),
        request_throughput=sum(r.request_throughput for r in seed_runs) / n,
        output_throughput=sum(r.output_throughput for r in seed_runs) / n,
    )
