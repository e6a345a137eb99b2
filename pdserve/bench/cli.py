"""`pdserve bench`: SLO-goodput sweep over deployment configurations, with report and plots.

    pdserve bench                      # the default preset into benchmarks/default (resumes if re-run)
    pdserve bench --quick              # a few minutes: PD against plain serving, tiny model
    pdserve bench --configs collocated,round-robin,write --rates 2,4,6 --out benchmarks/mine
    pdserve bench --workload decode-heavy --out benchmarks/decode-heavy
    pdserve bench --tune write=default,512,256 --tune adaptive=512/256,512/128
    pdserve bench --configs write,write-two-host,read,read-two-host    # PD on one host vs across two namespaces (root)
    pdserve bench --report-only --out benchmarks/default [--slo gap30:ttft<1000,max_gap<30]

Re-running the same command continues an interrupted run where it stopped; a results directory
holding a different plan is refused.
"""

from __future__ import annotations

import argparse
import dataclasses
import signal
import sys
from pathlib import Path

from pdserve.bench.budget import TWO_HOST_CONFIGS, TWO_HOST_SUFFIX, base_config
from pdserve.bench.deployment import BENCH_PORT
from pdserve.bench.plan import KNOWN_CONFIGS, BenchPlan
from pdserve.bench.presets import OPTIONAL_CONFIGS, PRESETS, RATIONALE, WORKLOADS, preset, with_workload
from pdserve.bench.results import ResultsDir
from pdserve.errors import ConfigError
from pdserve.slo import SLO


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("bench", help="SLO goodput sweep over configurations (vllm bench serve)",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=sorted(PRESETS), default="default")
    p.add_argument("--quick", action="store_const", const="quick", dest="preset", help="same as --preset quick")
    p.add_argument("--configs", help=f"comma list from {', '.join(KNOWN_CONFIGS)}, and adaptive@NAME "
                                     f"(adaptive declaring the plan's SLO NAME, e.g. adaptive@tight)")
    p.add_argument("--rates", help="comma list of request rates (req/s; replaces the calibrated grid)")
    p.add_argument("--rate-fractions", help="comma list of rates as fractions of the calibrated capacity")
    p.add_argument("--workload", choices=sorted(WORKLOADS), help="named workload (lengths and kind)")
    p.add_argument("--seeds", help="comma list of arrival seeds (same for every configuration)")
    p.add_argument("--interleave", action=argparse.BooleanOptionalAction, default=None,
                   help="configurations take turns seed by seed, one deployment per configuration and seed, "
                        "so machine drift spreads over all of them (default: the preset's; on in `default`)")
    p.add_argument("--num-prompts", type=int, help="requests per point")
    p.add_argument("--input-len", type=int)
    p.add_argument("--output-len", type=int)
    p.add_argument("--burstiness", type=float, help="gamma shape of inter-arrival times (1 = Poisson)")
    p.add_argument("--slo", action="append", metavar="NAME:SPEC",
                   help="SLO, e.g. blog:ttft<1000,mean_itl<50 or stall:ttft<500,max_gap<100 (repeat; replaces the preset's)")
    p.add_argument("--model", help="model size (tiny, small) or model directory")
    p.add_argument("--headline-rate", type=float,
                   help="rate of the requests-meeting-SLO table and of tuning (a fraction of capacity with a calibrated grid)")
    p.add_argument("--warmup-fraction", type=float, help="share of the arrival span not scored at the start (default 0.2)")
    p.add_argument("--cooldown-fraction", type=float, help="share of the arrival span not scored at the end (default 0.1)")
    p.add_argument("--tune", action="append", metavar="CONFIG=BUDGET,...",
                   help="budgets to tune CONFIG over, e.g. round-robin=default,256 or adaptive=512/256,default/128 "
                        "(repeat; replaces the preset's for that CONFIG; CONFIG= alone: no tuning)")
    p.add_argument("--tune-slo", help="name of the SLO whose attainment tuning maximises (default: the first)")
    p.add_argument("--target", type=float, help="attainment a rate needs to count for goodput (default 0.9)")
    p.add_argument("--chunked-tokens", type=int, help="fixed --max-num-batched-tokens for `chunked` (no tuning)")
    p.add_argument("--chunk-candidates", help="comma list of budgets to tune `chunked` over (same as --tune chunked=...)")
    p.add_argument("--out", type=Path, help="results directory (default <project>/benchmarks/<preset>)")
    p.add_argument("--port", type=int, default=BENCH_PORT,
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
        over["rates"], over["rate_fractions"] = tuple(_numbers(args.rates, float)), ()
        if args.headline_rate is None and plan.calibrated:
            over["headline_rate"] = max(over["rates"])
    if args.rate_fractions:
        over["rates"], over["rate_fractions"] = (), tuple(_numbers(args.rate_fractions, float))
    if args.seeds:
        over["seeds"] = tuple(_numbers(args.seeds, int))
    if args.slo:
        over["slos"] = tuple(SLO.parse(s) for s in args.slo)
    for name in ("model", "headline_rate", "target", "warmup_fraction", "cooldown_fraction", "tune_slo", "interleave"):
        if getattr(args, name) is not None:
            over[name] = getattr(args, name)
    candidates = dict(plan.candidates)
    if args.chunked_tokens is not None:
        over["chunked_tokens"] = args.chunked_tokens
        candidates.pop("chunked", None)
    if args.chunk_candidates:
        candidates["chunked"] = tuple(str(n) for n in _numbers(args.chunk_candidates, int))
    for text in args.tune or ():
        config, sep, specs = text.partition("=")
        if not sep:
            raise ConfigError(f"--tune {text!r} is not CONFIG=BUDGET,... (e.g. write=default,512)")
        candidates[config.strip()] = _strings(specs)
    for config in over.get("configs", plan.configs):  # a two-host configuration is tuned like its one-host twin
        twin = config.removesuffix(TWO_HOST_SUFFIX)
        if twin != config and config not in candidates and twin in candidates:
            candidates[config] = candidates[twin]
    over["candidates"] = tuple((c, specs) for c, specs in candidates.items() if specs)
    workload = {k: v for k, v in (("num_prompts", args.num_prompts), ("input_len", args.input_len),
                                  ("output_len", args.output_len), ("burstiness", args.burstiness)) if v is not None}
    plan = dataclasses.replace(plan, **over)
    if args.workload:
        plan = with_workload(plan, args.workload)
    if workload:
        plan = dataclasses.replace(plan, workload=dataclasses.replace(plan.workload, **workload))
    if "slos" in over and plan.tune_slo not in [s.name for s in plan.slos]:
        plan = dataclasses.replace(plan, tune_slo="")
    return plan


def drop_unregistered(plan: BenchPlan, explicit: bool) -> tuple[BenchPlan, list[str]]:
    """A preset's optional configurations (adaptive) whose launcher mode is not registered are dropped,
    with a note; asked for explicitly (--configs), they stay and the run refuses them."""
    if explicit:
        return plan, []
    from pdserve.bench.launcher_deployer import LauncherDeployer

    deployer = LauncherDeployer()
    missing = [c for c in plan.configs if base_config(c) in OPTIONAL_CONFIGS and deployer.unavailable(c)]
    if not missing:
        return plan, []
    kept = tuple(c for c in plan.configs if c not in missing)
    notes = [f"{c}: left out, its launcher mode is not registered yet." for c in missing]
    return dataclasses.replace(plan, configs=kept, candidates=tuple(x for x in plan.candidates if x[0] in kept)), notes


def run(args: argparse.Namespace) -> int:
    from pdserve.launch.env import project_root

    results = ResultsDir(args.out or project_root() / "benchmarks" / args.preset)
    if args.report_only:
        from pdserve.bench.runner import publish

        plan = results.open_plan(None)
        added: list[str] = []
        if args.slo:  # other SLO definitions, evaluated on the same measured requests
            measured = {s.name for s in plan.slos}
            slos = tuple(SLO.parse(s) for s in args.slo)
            added = [s.name for s in slos if s.name not in measured]
            plan = dataclasses.replace(plan, slos=slos, tune_slo="")
        print(publish(plan, results, added_slos=added))
        return 0
    plan, dropped = drop_unregistered(build_plan(args), explicit=bool(args.configs))
    plan = results.open_plan(plan)
    from pdserve.bench.launcher_deployer import LauncherDeployer
    from pdserve.bench.runner import Runner, estimate_s
    from pdserve.model.build import resolve_model

    base = preset(args.preset)
    changed = [k for k, v in plan.to_json().items() if base.to_json()[k] != v]
    notes = [RATIONALE[args.preset] + (f" Overridden here: {', '.join(changed)}." if changed else ""), *dropped]
    two_host = any(c in TWO_HOST_CONFIGS for c in plan.configs)
    if "nixl" in plan.configs or two_host:  # two hosts: the KV moves over pdserve's NIXL transport
        from pdserve.launch.nixl_mode import ensure_nixl

        ensure_nixl()
    if "nixl" in plan.configs:
        from pdserve.launch.nixl_mode import WORKAROUNDS_NOTE

        notes.append(WORKAROUNDS_NOTE)
    if two_host:
        from pdserve.bench.two_host_deployment import NOTE

        notes.append(NOTE)
    print(f"pdserve bench: {len(plan.configs)} configurations, about {estimate_s(plan) / 60:.0f} min from scratch "
          f"(estimate) -> {results.root}", file=sys.stderr)
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
