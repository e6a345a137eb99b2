"""The Markdown report of a results directory: setup, headline table, goodput, curves, latencies."""

from __future__ import annotations

import datetime
import math
from collections import Counter
from pathlib import Path
from typing import Mapping, Sequence

from pdserve.bench import placements
from pdserve.bench.attainment import Verdict
from pdserve.bench.budget import PLAIN_CONFIGS, STATIC_OF_ADAPTIVE, base_config
from pdserve.bench.calibrate import Calibration
from pdserve.bench.comparison import BLOCK_REQUESTS, Comparison, compare
from pdserve.bench.goodput import Bound, ratio
from pdserve.bench.plan import BenchPlan, Point
from pdserve.bench.records import BenchRun
from pdserve.bench.stats import CONFIDENCE, NUM_RESAMPLES, Interval
from pdserve.bench.summary import Curve, curve, latency, window
from pdserve.bench.tune import OBJECTIVE, TuneLog

GOODPUT_RULES = """\
Goodput (DistServe): the highest offered rate at which at least {target:.0%} of requests meet the SLO,
computed on the attainment curve of the scored requests pooled over seeds. Rates are walked upwards; the
value is linearly interpolated between the last passing rate and the first failing one (the point where
the line between them crosses {target:.0%}); the last passing measured rate is shown as "step". If every
rate passes, goodput is the highest rate and a lower bound (≥). If the lowest rate already fails,
goodput is 0 and only known to be below the lowest rate ("<r (0)"); a ratio over such a goodput is a
lower bound "≥ g" with g = numerator / lowest rate. A rate that passes again above the first failure
is ignored and marked (non-monotonic). Attainment counts every scored request, failed ones as misses;
a request meets an SLO when each bound holds strictly (TTFT < limit, mean inter-chunk gap < limit,
max gap < limit).

Statistics: attainment intervals are Wilson {conf:.0%} intervals of the pooled scored requests
(scipy.stats.binomtest). Goodput and ratio intervals are {conf:.0%} percentile-bootstrap intervals
(scipy.stats.bootstrap, {resamples} resamples) over blocks of {block} consecutive scored requests of
every seed; the same blocks are drawn for every configuration and rate, since every configuration got
the same request stream, so each ratio's interval is that of a paired comparison. The same resamples
give each per-rate attainment difference ("Attainment minus ...") its interval: it tells two
configurations apart where their goodputs cannot (both below the lowest rate or above the highest).
Every configuration is set against the best plain one; adaptive placement also against each other
plain configuration and against its static disaggregation.
"""


def write_report(plan: BenchPlan, runs: dict[Point, BenchRun], path: Path, notes: Sequence[str] = (),
                 plots: Sequence[Path] = (), calibration: Calibration | None = None, tune_log: TuneLog | None = None,
                 added_slos: Sequence[str] = (), rate_fractions: Sequence[float] = (),
                 headline_fraction: float | None = None,
                 placement_counts: Mapping[Point, placements.Counts] | None = None) -> str:
    """Render the report for the points measured so far, write it to ``path``, return the text."""
    curves = {(c, slo.name): cv for c in plan.configs for slo in plan.slos
              if (cv := curve(plan, runs, c, slo)) is not None}
    missing = [p.key for p in plan.points() if p not in runs]
    lines = ["# pdserve bench report", "",
             f"Generated {datetime.datetime.now().isoformat(timespec='seconds')}. " + _setup(plan), ""]
    if missing:
        lines += [f"**Incomplete: {len(missing)} of {len(plan.points())} points not measured** "
                  f"({', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}).", ""]
    lines += ["## Setup", ""] + [f"- {item}" for item in _setup_items(plan, calibration, tune_log, rate_fractions,
                                                                       headline_fraction, runs)] + [""]
    if notes:
        lines += ["## Notes", ""] + [f"- {n}" for n in notes] + [""]
    for slo in plan.slos:
        comparison = compare(plan, runs, slo)
        added = slo.name in added_slos
        lines += [f"## SLO `{slo}`" + (" (added after the run, with --report-only)" if added else ""), ""]
        lines += _headline(plan, curves, slo.name)
        lines += _goodput(plan, curves, slo.name, comparison)
        lines += _curves(plan, curves, slo.name)
        lines += _differences(plan, curves, slo.name, comparison)
    lines += _latencies(plan, runs)
    lines += placements.section(_placement_rows(plan, placement_counts or {}))
    if plots:
        lines += ["## Plots", ""]
        lines += [f"![{p.stem}]({p.relative_to(path.parent).as_posix()})" for p in plots] + [""]
    lines += ["## Definitions", "", GOODPUT_RULES.format(target=plan.target, conf=CONFIDENCE,
                                                         resamples=NUM_RESAMPLES, block=BLOCK_REQUESTS)]
    text = "\n".join(lines) + "\n"
    path.write_text(text)
    return text


def _placement_rows(plan: BenchPlan, counts: Mapping[Point, placements.Counts]) -> list:
    """(configuration, rate, decisions summed over the seeds) in the plan's order."""
    rows = []
    for config in plan.configs:
        for rate in sorted(plan.rates):
            summed: Counter[str] = Counter()
            for point, point_counts in counts.items():
                if point.config == config and point.rate == rate:
                    summed.update(point_counts)
            rows.append((config, rate, dict(summed)))
    return rows


def _setup(plan: BenchPlan) -> str:
    w = plan.workload
    streams = ("an earlier bench version: vLLM's random dataset, the same stream in every configuration but another "
               "at each rate" if plan.legacy else "the same stream in every configuration and, scaled, at every rate")
    kind = {"shared-prefix": f"shared-prefix ({w.num_prefixes} prefixes of {w.prefix_len} tokens, prefix caching on)",
            "multi-turn": f"multi-turn chat ({w.turns} turns per conversation, each turn's request holding the "
                          f"earlier turns and answers; ISL = new tokens per turn; prefix caching on; requests "
                          f"per point = conversations x turns)"}.get(w.kind, "random-token prompts")
    return (f"Model `{plan.model}`; {kind}, ISL {w.input_len} / OSL {w.output_len} (--ignore-eos, temperature 0), "
            f"{w.num_prompts} requests per point, arrivals gamma burstiness {w.burstiness:g} (1 = Poisson); "
            f"rates {', '.join(f'{r:g}' for r in sorted(plan.rates))} req/s; arrival seeds "
            f"{', '.join(map(str, plan.seeds))} ({streams}); configurations: {', '.join(plan.configs)}.")


def _setup_items(plan: BenchPlan, calibration: Calibration | None, tune_log: TuneLog | None,
                 rate_fractions: Sequence[float], headline_fraction: float | None,
                 runs: dict[Point, BenchRun]) -> list[str]:
    items = []
    if calibration is not None:
        items.append(calibration.describe())
    if rate_fractions:
        items.append(f"Rates: {', '.join(f'{f:g}' for f in rate_fractions)} x the estimated capacity; headline "
                     f"rate {headline_fraction:g} x capacity.")
    sizes = [len(window(plan, s)) for s in plan.seeds]
    if plan.warmup_fraction == plan.cooldown_fraction == 0:
        items.append("Scored: every request of each point (this plan has no steady window).")
    else:
        items.append(f"Scored: the steady window of each point, the requests arriving between "
                     f"{plan.warmup_fraction:.0%} and {1 - plan.cooldown_fraction:.0%} of the arrival span "
                     f"(the warm-up from an empty system and the drain after the last arrivals are sent but not "
                     f"scored): {', '.join(map(str, sizes))} of {plan.workload.num_requests} requests per seed, the "
                     f"same requests at every rate and in every configuration.")
    if plan.interleave:
        items.append("Order: interleaved, seed by seed: each seed is a round in which every configuration runs "
                     "that seed's points in a deployment of its own, the order rotating from round to round, so "
                     "drift of the machine over the run shifts every configuration alike.")
    elif len(plan.configs) > 1:
        items.append("Order: one configuration after another (one deployment each): drift of the machine over "
                     "the run is not spread over the configurations (`--interleave` spreads it).")
    declared = [f"`{c}` declares `{slo.spec}`" for c in plan.configs if (slo := plan.declared_slo(c))]
    if declared:
        bases = sorted({base_config(c) for c in plan.configs if plan.declared_slo(c)})
        names = " and ".join(f"`{b}`" for b in bases)
        items.append("Declared SLOs (adaptive placement told the SLO it serves, `pdserve up --slo`): "
                     + "; ".join(declared) + f"; {names} declare{'s' if len(bases) == 1 else ''} none (default "
                     f"bounds). Where {names} run{'s' if len(bases) == 1 else ''} too, a variant without candidates "
                     "of its own uses the budget its tuning chose (a declared SLO is not a budget).")
    tuned = [d for c in plan.configs if tune_log and (d := tune_log.describe(c))]
    if tuned:
        items.append(f"Tuning (same procedure for every tuned configuration, tuning stream at "
                     f"{tune_log.rate:g} req/s, SLO `{tune_log.slo}`; objective: {OBJECTIVE}; attainment per "
                     f"candidate in parentheses, details in tune.json): " + "; ".join(tuned) + ".")
    fixed = [f"{c} {b[0]}" for c in plan.configs if len(b := plan.budgets(c)) == 1]
    if fixed:
        items.append(f"Fixed budget (one candidate, not tuned): {', '.join(fixed)}.")
    untuned = [c for c in plan.configs if not plan.budgets(c)]
    if untuned and not plan.legacy:  # a legacy run's notes say what it tuned
        chunked = f" (chunked: {plan.chunked_tokens})" if "chunked" in untuned else ""
        items.append(f"Not tuned, vLLM's default budget{chunked}: {', '.join(untuned)}.")
    short = sum(run.num_short(plan.workload.output_len) for run in runs.values())
    total = sum(len(run.records) for run in runs.values())
    items.append(f"Output length: {short} of {total} requests finished short of the requested "
                 f"{plan.workload.output_len} tokens.")
    return items


def _headline(plan: BenchPlan, curves: dict, slo_name: str) -> list[str]:
    rate = plan.headline
    lines = [f"### Requests meeting the SLO at {rate:g} req/s (cf. MoRIIO blog Table 3)", "",
             "| configuration | met / scored | attainment (95 % CI) | main cause of misses | misses: TTFT / ITL / both / failed |",
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
            f"| {config} | {at.num_met} / {at.num_requests} | {_attainment(at)} | {cause} | "
            f"{m.get(Verdict.TTFT, 0)} / {m.get(Verdict.ITL, 0)} / {m.get(Verdict.BOTH, 0)} / {m.get(Verdict.FAILED, 0)} |")
    return lines + [""]




def _statics(plan: BenchPlan) -> list[str]:
    """The static disaggregations in the plan whose adaptive placement is in it too (write for
    adaptive, read for adaptive-read)."""
    bases = {base_config(c) for c in plan.configs}
    return [s for a, s in STATIC_OF_ADAPTIVE.items() if a in bases and s in plan.configs]


def best_plain(plan: BenchPlan, curves: dict, slo_name: str) -> str | None:
    """The plain configuration with the highest goodput under this SLO (first listed on ties)."""
    plain = [c for c in plan.configs if c in PLAIN_CONFIGS and (c, slo_name) in curves]
    return max(plain, key=lambda c: curves[(c, slo_name)].goodput.value, default=None)


def _goodput(plan: BenchPlan, curves: dict, slo_name: str, comparison: Comparison | None) -> list[str]:
    best = best_plain(plan, curves, slo_name)
    plain = [c for c in plan.configs if c in PLAIN_CONFIGS and (c, slo_name) in curves]
    # static write (read) too, where adaptive placement in that mode is compared: it should lose to neither
    bases = plain + [s for s in _statics(plan) if (s, slo_name) in curves]
    head = ["configuration", "goodput (req/s) [95 % CI]", "step", "per seed",
            *([f"÷ best plain ({best})"] if best and len(plain) > 1 else []), *(f"÷ {b}" for b in bases)]
    columns = ([best] if best and len(plain) > 1 else []) + bases
    lines = [f"### Goodput (≥ {plan.target:.0%} attainment)", "", "| " + " | ".join(head) + " |",
             "|" + "---|" * len(head)]
    for config in plan.configs:
        cv: Curve | None = curves.get((config, slo_name))
        if cv is None:
            lines.append(f"| {config} | not measured | | |" + " |" * len(columns))
            continue
        g = cv.goodput
        flag = " (non-monotonic)" if g.non_monotonic else ""
        ci = comparison.goodput_ci.get(config) if comparison else None
        step = f"{g.step:g}" if g.bound is not Bound.UPPER else "—"
        seeds = ", ".join(str(s) for s in cv.seed_goodputs)
        cells = []
        for base in columns:
            if base == config:
                cells.append("—")
                continue
            text = str(ratio(g, curves[(base, slo_name)].goodput))
            pair_ci = comparison.ratio_ci.get((config, base)) if comparison else None
            cells.append(text + (f" {pair_ci}" if _defined(pair_ci) and text != "n/a" else ""))
        shown = f" {ci}" if _defined(ci) and g.bound is not Bound.UPPER else ""
        lines.append("| " + " | ".join([config, f"{g}{flag}{shown}", step, seeds, *cells]) + " |")
    return lines + [""]


def _curves(plan: BenchPlan, curves: dict, slo_name: str) -> list[str]:
    rates = sorted(plan.rates)
    lines = ["### Attainment per rate (pooled scored requests, Wilson 95 % CI)", "",
             "| configuration | " + " | ".join(f"{r:g}" for r in rates) + " |", "|---|" + "---|" * len(rates)]
    for config in plan.configs:
        cv = curves.get((config, slo_name))
        cells = [(_attainment(at) if (at := cv.at(r)) else "") if cv else "" for r in rates]
        lines.append(f"| {config} | " + " | ".join(cells) + " |")
    return lines + [""]


def _differences(plan: BenchPlan, curves: dict, slo_name: str, comparison: Comparison | None) -> list[str]:
    """Attainment minus the best plain configuration's at each rate, on the same requests, with the
    paired bootstrap interval: it tells configurations apart where their goodputs cannot (both
    below the lowest rate, or both above the highest). Adaptive placement is also set against every
    other plain configuration (the best by goodput is first listed on ties, and the claim is
    against each of them) and against its static disaggregation (write, read)."""
    if comparison is None or not comparison.difference_ci:
        return []
    rates = sorted(plan.rates)
    best = best_plain(plan, curves, slo_name)
    tables = [(best, [c for c in plan.configs if c != best])] if best else []
    adaptive = [c for c in plan.configs if base_config(c) in STATIC_OF_ADAPTIVE]
    tables += [(plain, adaptive) for plain in plan.configs
               if plain in PLAIN_CONFIGS and plain != best and (plain, slo_name) in curves]
    for static in _statics(plan):
        if static != best:
            tables.append((static, [c for c in plan.configs if STATIC_OF_ADAPTIVE.get(base_config(c)) == static]))
    lines = []
    for base, rows in tables:
        rows = [c for c in rows if any((c, base, r) in comparison.difference_ci for r in rates)]
        if not rows:
            continue
        lines += [f"### Attainment minus {base}'s, per rate (same requests; paired block bootstrap, 95 % CI)", "",
                  "| configuration | " + " | ".join(f"{r:g}" for r in rates) + " |", "|---|" + "---|" * len(rates)]
        for config in rows:
            cells = []
            for r in rates:
                ci = comparison.difference_ci.get((config, base, r))
                a, b = curves[(config, slo_name)].at(r), curves[(base, slo_name)].at(r)
                cells.append(f"{a.attainment.fraction - b.attainment.fraction:+.2f} {ci}"
                             if ci is not None and a and b else "")
            lines.append(f"| {config} | " + " | ".join(cells) + " |")
        lines.append("")
    return lines


def _latencies(plan: BenchPlan, runs: dict[Point, BenchRun]) -> list[str]:
    lines = ["## Latency per rate (ms, scored requests pooled over seeds, successful ones)", "",
             "Send lag: how late the bench client sent requests against the schedule (it shares the cores).", "",
             "| configuration | rate | TTFT p50/p90 | mean ITL p50/p90 | max gap p50/p90 | failed | short | send lag p99 | req/s | out tok/s |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    if plan.legacy:  # its requests did not follow pdserve's schedule
        lines = [line.replace(" send lag p99 |", "").replace("---|---|---|---|---|---|---|---|---|---|", "---|" * 9)
                 for line in lines[:2] + lines[4:]]
    for config in plan.configs:
        for rate in sorted(plan.rates):
            lat = latency(plan, runs, config, rate)
            if lat is None:
                continue
            lines.append(
                f"| {config} | {rate:g} | {_ms(lat.ttft_p50)}/{_ms(lat.ttft_p90)} | "
                f"{_ms(lat.mean_itl_p50, 1)}/{_ms(lat.mean_itl_p90, 1)} | {_ms(lat.max_gap_p50)}/{_ms(lat.max_gap_p90)} | "
                f"{lat.num_failed}/{lat.num_requests} | {lat.num_short} | "
                + ("" if plan.legacy else f"{_ms(lat.send_lag_p99_ms)} | ") + f"{lat.request_throughput:.2f} | "
                f"{lat.output_throughput:.0f} |")
    return lines + [""]


def _defined(ci: Interval | None) -> bool:
    return ci is not None and not (math.isnan(ci.low) or math.isnan(ci.high))


def _attainment(at) -> str:
    ci: Interval | None = at.ci
    return f"{at.attainment.fraction:.2f}" + (f" {ci}" if ci else "")


def _ms(value: float, digits: int = 0) -> str:
    return "—" if math.isnan(value) else f"{value:.{digits}f}"
