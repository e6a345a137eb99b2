"""`pdserve bench`: SLO-goodput sweep over deployment configurations, with report and plots.

    pdserve bench                      # the default preset into benchmarks/default (resumes if re-run)
    pdserve bench --quick              # ~4 min smoke run into benchmarks/quick
    pdserve bench --configs collocated,round-robin,write --rates 2,4,6 --out benchmarks/mine
    pdserve bench --report-only --out benchmarks/default

Re-running the same command continues an interrupted run where it stopped; a results directory
holding a different plan is refused.
"""

from __future__ import annotations

import argparse
import dataclasses
import signal
import sys
from pathlib import Path

from pdserve.bench.plan import KNOWN_CONFIGS, BenchPlan
from pdserve.bench.presets import PRESETS, RATIONALE, preset
from pdserve.bench.results import ResultsDir
from pdserve.bench.slo import SLO
from pdserve.errors import ConfigError


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("bench", help="SLO goodput sweep over configurations (vllm bench serve)",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=sorted(PRESETS), default="default")
    p.add_argument("--quick", action="store_const", const="quick", dest="preset", help="same as --preset quick")
    p.add_argument("--configs", help=f"comma list from {', '.join(KNOWN_CONFIGS)}")
    p.add_argument("--rates", help="comma list of request rates (req/s)")
    p.add_argument("--seeds", help="comma list of arrival seeds (same for every configuration)")
    p.add_argument("--num-prompts", type=int, help="requests per point")
    p.add_argument("--input-len", type=int)
    p.add_argument("--output-len", type=int)
    p.add_argument("--burstiness", type=float, help="gamma shape of inter-arrival times (1 = Poisson)")
    p.add_argument("--slo", action="append", metavar="NAME:SPEC",
                   help="SLO, e.g. blog:ttft<1000,mean_itl<50 or stall:ttft<500,max_gap<100 (repeat; replaces the preset's)")
    p.add_argument("--model", help="model size (tiny, small) or model directory")
    p.add_argument("--headline-rate", type=float, help="rate of the requests-meeting-SLO table")
    p.add_argument("--target", type=float, help="attainment a rate needs to count for goodput (default 0.9)")
    p.add_argument("--chunked-tokens", type=int, help="fixed --max-num-batched-tokens for `chunked` (no tuning)")
    p.add_argument("--chunk-candidates", help="comma list of budgets to tune `chunked` over")
    p.add_argument("--out", type=Path, help="results directory (default <project>/benchmarks/<preset>)")
    p.add_argument("--port", type=int, default=18800,
                   help="client-facing port of each deployment; it uses the next 9 too (default 18800; keep it below the kernel's ephemeral range, 32768+)")
    p.add_argument("--report-only", action="store_true",
                   help="rewrite report and plots from existing results (with --slo: for those SLOs instead)")
    p.set_defaults(func=run)


def build_plan(args: argparse.Namespace) -> BenchPlan:
    """The preset with the command line's overrides applied."""
    plan = preset(args.preset)
    over: dict = {}
    if args.configs:
        over["configs"] = _strings(args.configs)
    if args.rates:
        over["rates"] = tuple(_numbers(args.rates, float))
    if args.seeds:
        over["seeds"] = tuple(_numbers(args.seeds, int))
    if args.slo:
        over["slos"] = tuple(SLO.parse(s) for s in args.slo)
    for name in ("model", "headline_rate", "target"):
        if getattr(args, name) is not None:
            over[name] = getattr(args, name)
    if args.chunked_tokens is not None:
        over["chunked_tokens"], over["chunk_candidates"] = args.chunked_tokens, ()
    if args.chunk_candidates:
        over["chunk_candidates"] = tuple(_numbers(args.chunk_candidates, int))
    workload = {k: v for k, v in (("num_prompts", args.num_prompts), ("input_len", args.input_len),
                                  ("output_len", args.output_len), ("burstiness", args.burstiness)) if v is not None}
    if workload:
        over["workload"] = dataclasses.replace(plan.workload, **workload)
    return dataclasses.replace(plan, **over)


def run(args: argparse.Namespace) -> int:
    from pdserve.launch.env import project_root

    results = ResultsDir(args.out or project_root() / "benchmarks" / args.preset)
    if args.report_only:
        from pdserve.bench.runner import publish

        plan = results.open_plan(None)
        if args.slo:  # other SLO definitions, evaluated on the same measured requests
            plan = dataclasses.replace(plan, slos=tuple(SLO.parse(s) for s in args.slo))
        print(publish(plan, results))
        return 0
    plan = results.open_plan(build_plan(args))
    from pdserve.bench.deployment import LauncherDeployer
    from pdserve.bench.runner import Runner
    from pdserve.model.build import resolve_model

    base = preset(args.preset)
    changed = [k for k, v in plan.to_json().items() if base.to_json()[k] != v]
    notes = [RATIONALE[args.preset] + (f" Overridden here: {', '.join(changed)}." if changed else "")]
    if "nixl" in plan.configs:
        from pdserve.launch.nixl_mode import WORKAROUNDS_NOTE, ensure_nixl

        ensure_nixl()
        notes.append(WORKAROUNDS_NOTE)
    runner = Runner(plan, results, LauncherDeployer(port=args.port), resolve_model(plan.model), notes=notes)
    previous = signal.signal(signal.SIGTERM, _interrupt)  # SIGTERM unwinds like Ctrl-C: everything is stopped
    try:
        path = runner.run()
    except KeyboardInterrupt:
        print(f"\npdserve bench: interrupted; everything stopped. Re-run the same command to resume "
              f"({results.root}).", file=sys.stderr)
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)
    print(path)
    return 0


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def _strings(text: str) -> tuple[str, ...]:
    return tuple(s.strip() for s in text.split(",") if s.strip())


def _numbers(text: str, kind: type) -> list:
    try:
        return [kind(s) for s in _strings(text)]
    except ValueError as exc:
        raise ConfigError(f"not a list of numbers: {text!r}") from exc
