"""The Markdown report of a results directory: headline table, goodput, curves, latencies."""

from __future__ import annotations

import datetime
import math
from pathlib import Path
from typing import Sequence

from pdserve.bench.attainment import Verdict
from pdserve.bench.goodput import Bound, ratio
from pdserve.bench.plan import BenchPlan, Point
from pdserve.bench.records import BenchRun
from pdserve.bench.summary import Curve, curve, latency

BASELINES = ("round-robin", "collocated", "chunked", "nixl")

GOODPUT_RULES = """\
Goodput (DistServe): the highest offered rate at which at least {target:.0%} of requests meet the SLO,
computed on the seed-mean attainment curve. Rates are walked upwards; the value is linearly
interpolated between the last passing rate and the first failing one (the point where the line
between them crosses {target:.0%}); the last passing measured rate is shown as "step". If every
rate passes, goodput is the highest rate and a lower bound (≥). If the lowest rate already fails,
goodput is 0 and only known to be below the lowest rate ("<r (0)"); no attainment is assumed
below the measured range. A rate that passes again above the first failure is ignored and marked
(non-monotonic). Attainment counts every request sent, failed ones as misses; a request meets an
SLO when each bound holds strictly (TTFT < limit, mean inter-chunk gap < limit, max gap < limit).
Attainment is the mean over arrival seeds with a 95 % t-distribution confidence interval.
"""


def write_report(plan: BenchPlan, runs: dict[Point, BenchRun], path: Path,
                 notes: Sequence[str] = (), plots: Sequence[Path] = ()) -> str:
    """Render the report for the points measured so far, write it to ``path``, return the text."""
    curves = {(c, slo.name): cv for c in plan.configs for slo in plan.slos
              if (cv := curve(plan, runs, c, slo)) is not None}
    missing = [p.key for p in plan.points() if p not in runs]
    lines = ["# pdserve bench report", "",
             f"Generated {datetime.datetime.now().isoformat(timespec='seconds')}. " + _setup(plan), ""]
    if missing:
        lines += [f"**Incomplete: {len(missing)} of {len(plan.points())} points not measured** "
                  f"({', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}).", ""]
    if notes:
        lines += ["## Notes", ""] + [f"- {n}" for n in notes] + [""]
    for slo in plan.slos:
        lines += _headline(plan, curves, slo.name, str(slo))
        lines += _goodput(plan, curves, slo.name)
        lines += _curves(plan, curves, slo.name)
    lines += _latencies(plan, runs)
    if plots:
        lines += ["## Plots", ""]
        lines += [f"![{p.stem}]({p.relative_to(path.parent).as_posix()})" for p in plots] + [""]
    lines += ["## Definitions", "", GOODPUT_RULES.format(target=plan.target)]
    text = "\n".join(lines) + "\n"
    path.write_text(text)
    return text


def _setup(plan: BenchPlan) -> str:
    w = plan.workload
    return (f"Model `{plan.model}`; random dataset ISL {w.input_len} / OSL {w.output_len} (--ignore-eos, "
            f"temperature 0), {w.num_prompts} requests per point, arrivals gamma burstiness {w.burstiness:g} "
            f"(1 = Poisson); rates {', '.join(f'{r:g}' for r in sorted(plan.rates))} req/s; "
            f"arrival seeds {', '.join(map(str, plan.seeds))} (same in every configuration); "
            f"configurations: {', '.join(plan.configs)}.")


def _headline(plan: BenchPlan, curves: dict, slo_name: str, slo_text: str) -> list[str]:
    rate = plan.headline
    lines = [f"## SLO `{slo_text}`", "",
             f"### Requests meeting the SLO at {rate:g} req/s (cf. MoRIIO blog Table 3)", "",
             "| configuration | met / sent | attainment (95 % CI) | main cause of misses | misses: TTFT / ITL / both / failed |",
             "|---|---|---|---|---|"]
    for config in plan.configs:
        point = curves.get((config, slo_name))
        at = point.at(rate) if point else None
        if at is None:
            lines.append(f"| {config} | not measured | | | |")
            continue
        m = at.misses
        cause = at.main_miss_cause.value if at.main_miss_cause else "—"
        lines.append(
            f"| {config} | {at.num_met} / {at.num_requests} | {_ci(at.attainment)} | {cause} | "
            f"{m.get(Verdict.TTFT, 0)} / {m.get(Verdict.ITL, 0)} / {m.get(Verdict.BOTH, 0)} / {m.get(Verdict.FAILED, 0)} |")
    return lines + [""]


def _goodput(plan: BenchPlan, curves: dict, slo_name: str) -> list[str]:
    bases = [b for b in BASELINES if (b, slo_name) in curves]
    head = ["configuration", "goodput (req/s)", "step", "per seed", *(f"÷ {b}" for b in bases)]
    lines = [f"### Goodput (≥ {plan.target:.0%} attainment)", "", "| " + " | ".join(head) + " |",
             "|" + "---|" * len(head)]
    for config in plan.configs:
        cv: Curve | None = curves.get((config, slo_name))
        if cv is None:
            lines.append(f"| {config} | not measured | | |" + " |" * len(bases))
            continue
        g = cv.goodput
        flag = " (non-monotonic)" if g.non_monotonic else ""
        step = f"{g.step:g}" if g.bound is not Bound.UPPER else "—"
        seeds = ", ".join(str(s) for s in cv.seed_goodputs)
        ratios = ["—" if b == config else ratio(g, curves[(b, slo_name)].goodput) for b in bases]
        lines.append("| " + " | ".join([config, f"{g}{flag}", step, seeds, *ratios]) + " |")
    return lines + [""]


def _curves(plan: BenchPlan, curves: dict, slo_name: str) -> list[str]:
    rates = sorted(plan.rates)
    lines = ["### Attainment per rate (seed mean ± 95 % CI)", "",
             "| configuration | " + " | ".join(f"{r:g}" for r in rates) + " |", "|---|" + "---|" * len(rates)]
    for config in plan.configs:
        cv = curves.get((config, slo_name))
        cells = [(_ci(at.attainment) if (at := cv.at(r)) else "") if cv else "" for r in rates]
        lines.append(f"| {config} | " + " | ".join(cells) + " |")
    return lines + [""]


def _latencies(plan: BenchPlan, runs: dict[Point, BenchRun]) -> list[str]:
    lines = ["## Latency per rate (ms, pooled over seeds, successful requests)", "",
             "| configuration | rate | TTFT p50/p90 | mean ITL p50/p90 | max gap p50/p90 | failed | req/s | out tok/s |",
             "|---|---|---|---|---|---|---|---|"]
    for config in plan.configs:
        for rate in sorted(plan.rates):
            lat = latency(plan, runs, config, rate)
            if lat is None:
                continue
            lines.append(
                f"| {config} | {rate:g} | {_ms(lat.ttft_p50)}/{_ms(lat.ttft_p90)} | "
                f"{_ms(lat.mean_itl_p50, 1)}/{_ms(lat.mean_itl_p90, 1)} | {_ms(lat.max_gap_p50)}/{_ms(lat.max_gap_p90)} | "
                f"{lat.num_failed}/{lat.num_requests} | {lat.request_throughput:.2f} | {lat.output_throughput:.0f} |")
    return lines + [""]


def _ci(ci) -> str:
    if ci.half_width is None:
        return f"{ci.mean:.2f}"
    return f"{ci.mean:.2f} [{max(0.0, ci.low):.2f}, {min(1.0, ci.high):.2f}]"


def _ms(value: float, digits: int = 0) -> str:
    return "—" if math.isnan(value) else f"{value:.{digits}f}"
