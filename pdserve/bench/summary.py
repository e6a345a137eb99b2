"""Per-configuration, per-rate, per-SLO numbers derived from the measured points.

Only the steady window of each point is scored (``scored``): the requests arriving after the
plan's warm-up fraction and before its cool-down fraction of the arrival span (arrivals.py). The
same positions are scored at every rate and in every configuration.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Sequence

from pdserve.bench.arrivals import arrival_times, steady_window
from pdserve.bench.attainment import Attainment, Verdict, attainment
from pdserve.bench.goodput import Goodput, goodput
from pdserve.bench.plan import BenchPlan, Point
from pdserve.bench.records import BenchRun, RequestRecord
from pdserve.bench.stats import Interval, Proportion, percentile
from pdserve.errors import ConfigError
from pdserve.slo import SLO


def window(plan: BenchPlan, seed: int) -> range:
    """Positions scored in every point of ``seed`` (multi-turn: every turn of the conversations
    that start inside the window; records are in conversation-major order)."""
    w = plan.workload
    arrivals = steady_window(seed, w.num_prompts, w.burstiness, plan.warmup_fraction, plan.cooldown_fraction)
    return range(arrivals.start * w.turns, arrivals.stop * w.turns)


def scored(plan: BenchPlan, seed: int, records: Sequence[RequestRecord]) -> list[RequestRecord]:
    """The steady-window requests of one point (records in arrival order)."""
    if len(records) != plan.workload.num_requests:
        raise ConfigError(f"a point of seed {seed} holds {len(records)} requests, the plan sends "
                          f"{plan.workload.num_requests}")
    return [records[i] for i in window(plan, seed)]


@dataclass(frozen=True)
class RateResult:
    """One configuration at one rate against one SLO: the scored requests of every seed, pooled."""

    rate: float
    per_seed: tuple[Attainment, ...]

    @property
    def num_requests(self) -> int:
        return sum(a.num_requests for a in self.per_seed)

    @property
    def num_met(self) -> int:
        return sum(a.num_met for a in self.per_seed)

    @property
    def attainment(self) -> Proportion:
        return Proportion(self.num_met, self.num_requests)

    @property
    def ci(self) -> Interval | None:
        """Wilson 95 % interval of the pooled attainment."""
        return self.attainment.ci

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
    goodput: Goodput  # of the pooled curve
    seed_goodputs: tuple[Goodput, ...]  # the same computed on each seed's own curve

    def at(self, rate: float) -> RateResult | None:
        return next((r for r in self.rates if r.rate == rate), None)


@dataclass(frozen=True)
class Latency:
    """Pooled per-request latency percentiles (ms) of one configuration at one rate (scored requests)."""

    num_requests: int
    num_failed: int
    num_short: int  # finished without error but with fewer tokens than requested
    ttft_p50: float
    ttft_p90: float
    mean_itl_p50: float
    mean_itl_p90: float
    max_gap_p50: float
    max_gap_p90: float
    send_lag_p99_ms: float  # how late the client sent requests against the schedule (all requests)
    request_throughput: float  # mean over seeds, req/s (whole point)
    output_throughput: float  # mean over seeds, tok/s (whole point)


def curve(plan: BenchPlan, runs: dict[Point, BenchRun], config: str, slo: SLO) -> Curve | None:
    """The curve over the rates measured so far; None when the configuration has no points yet."""
    results = []
    for rate in sorted(plan.rates):
        per_seed = tuple(attainment(scored(plan, p.seed, runs[p].records), slo)
                         for p in (Point(config, rate, s) for s in plan.seeds) if p in runs)
        if per_seed:
            results.append(RateResult(rate, per_seed))
    if not results:
        return None
    rates = [r.rate for r in results]
    pooled = goodput(rates, [r.attainment.fraction for r in results], plan.target)
    seed_curves = []
    for seed in plan.seeds:
        pts = [(rate, attainment(scored(plan, seed, runs[p].records), slo).fraction)
               for rate in rates if (p := Point(config, rate, seed)) in runs]
        if pts:
            seed_curves.append(goodput([r for r, _ in pts], [a for _, a in pts], plan.target))
    return Curve(config, slo, tuple(results), pooled, tuple(seed_curves))


def send_lags_ms(plan: BenchPlan, point: Point, run: BenchRun) -> list[float]:
    """Per request: actual send time minus scheduled arrival, both relative to the first request."""
    w = plan.workload
    schedule = arrival_times(point.seed, w.num_prompts, point.rate, w.burstiness)
    starts = [r.start_s for r in run.records]
    if w.turns > 1:  # only first turns follow the schedule
        return []
    if len(starts) != len(schedule) or any(s != s for s in starts):  # NaN: no start times recorded
        return []
    return [1000.0 * ((s - starts[0]) - t) for s, t in zip(starts, schedule)]


def records_at(plan: BenchPlan, runs: dict[Point, BenchRun], config: str, rate: float) -> list[RequestRecord]:
    """The scored requests of ``config`` at ``rate``, pooled over seeds."""
    return [r for s in plan.seeds if (p := Point(config, rate, s)) in runs for r in scored(plan, s, runs[p].records)]


def latency(plan: BenchPlan, runs: dict[Point, BenchRun], config: str, rate: float) -> Latency | None:
    seed_runs = [runs[p] for s in plan.seeds if (p := Point(config, rate, s)) in runs]
    if not seed_runs:
        return None
    records = records_at(plan, runs, config, rate)
    ok = [r for r in records if not r.failed]
    ttft = [r.ttft_ms for r in ok]
    mean_itl = [r.mean_itl_ms for r in ok]
    max_gap = [r.max_gap_ms for r in ok]
    n = len(seed_runs)
    return Latency(
        num_requests=len(records),
        num_failed=len(records) - len(ok),
        num_short=sum(1 for run in seed_runs for r in run.records if r.short_of(plan.workload.output_len)),
        ttft_p50=percentile(ttft, 50), ttft_p90=percentile(ttft, 90),
        mean_itl_p50=percentile(mean_itl, 50), mean_itl_p90=percentile(mean_itl, 90),
        max_gap_p50=percentile(max_gap, 50), max_gap_p90=percentile(max_gap, 90),
        send_lag_p99_ms=percentile([lag for s in plan.seeds if (p := Point(config, rate, s)) in runs
                                    for lag in send_lags_ms(plan, p, runs[p])], 99),
        request_throughput=sum(r.request_throughput for r in seed_runs) / n,
        output_throughput=sum(r.output_throughput for r in seed_runs) / n,
    )
