"""`pdserve bench`: SLO-goodput sweep over deployment configurations, with report and plots.

    pdserve bench --quick              # a few minutes: PD against plain serving, tiny model
    pdserve bench                      # the default preset (about 90-110 min on 2 cores)
    pdserve bench --configs collocated,round-robin,write --rates 2,4,6
    pdserve bench --workload decode-heavy
    pdserve bench --tune write=default,512,256 --tune adaptive=512/256,512/128
    pdserve bench --configs write,write-two-host,read,read-two-host    # PD on one host vs across two namespaces (root)
    pdserve bench --out DIR            # resume the run in DIR
    pdserve bench --report-only --out DIR [--slo gap30:ttft<1000,max_gap<30]

Each run writes a new directory <work dir>/runs/bench-<preset>-<date>-<time> (printed at the start).
--out DIR alone resumes the run in DIR; with plan flags it writes that plan there, refused where DIR
holds measurements of a different plan. Flags left out take the preset's values.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import signal
import sys
import time
from pathlib import Path

from pdserve.bench import args as check
from pdserve.bench.budget import TWO_HOST_CONFIGS, TWO_HOST_SUFFIX, base_config
from pdserve.bench.deployment import BENCH_PORT
from pdserve.bench.launcher_deployer import LauncherDeployer
from pdserve.bench.plan import KNOWN_CONFIGS, BenchPlan
from pdserve.bench.presets import OPTIONAL_CONFIGS, PRESETS, RATIONALE, WORKLOADS, preset, with_workload
from pdserve.bench.two_host_deployment import NOTE as TWO_HOST_NOTE
from pdserve.errors import ConfigError
from pdserve.launch.arguments import positive_int, token_count
from pdserve.launch.nixl_mode import WORKAROUNDS_NOTE, ensure_nixl
from pdserve.paths import work_dir

# the flags that set each field of a plan, for a refusal that names what to change
PLAN_FLAGS = {
    "configs": "--configs", "rates": "--rates", "rate_fractions": "--rate-fractions", "seeds": "--seeds",
    "workload": "--workload/--num-prompts/--input-len/--output-len/--burstiness", "slos": "--slo",
    "model": "--model", "headline_rate": "--headline-rate", "target": "--target",
    "chunked_tokens": "--chunked-tokens", "candidates": "--tune/--chunk-candidates",
    "warmup_prompts": "--preset", "warmup_fraction": "--warmup-fraction",
    "cooldown_fraction": "--cooldown-fraction", "tune_slo": "--tune-slo", "interleave": "--interleave",
    "legacy": "--preset",
}
PLAN_ARGS = ("preset", "configs", "rates", "rate_fractions", "workload", "seeds", "interleave", "num_prompts",
             "input_len", "output_len", "burstiness", "model", "headline_rate", "warmup_fraction",
             "cooldown_fraction", "tune", "tune_slo", "target", "chunked_tokens", "chunk_candidates")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("bench", help="SLO goodput sweep over configurations (vllm bench serve)",
                              description=__doc__)
    which = p.add_mutually_exclusive_group()
    which.add_argument("--preset", choices=sorted(PRESETS), help="ready-made plan (default: default)")
    which.add_argument("--quick", action="store_const", const="quick", dest="preset", help="same as --preset quick")
    p.add_argument("--configs", type=check.configs, metavar="LIST",
                   help=f"comma list from {', '.join(KNOWN_CONFIGS)}, and adaptive@NAME (adaptive declaring the "
                        f"plan's SLO NAME, e.g. adaptive@tight) {_preset_default(lambda p: ','.join(p.configs))}")
    grid = p.add_mutually_exclusive_group()
    grid.add_argument("--rates", type=check.rates, metavar="R,...",
                      help="comma list of request rates (req/s; replaces the calibrated grid)")
    grid.add_argument("--rate-fractions", type=check.rates, metavar="F,...",
                      help="comma list of rates as fractions of the capacity a calibration measures "
                           + _preset_default(lambda p: ",".join(f"{f:g}" for f in p.rate_fractions)))
    p.add_argument("--workload", choices=sorted(WORKLOADS), help="named workload: lengths and kind (default: random)")
    p.add_argument("--seeds", type=check.seeds, metavar="N,...",
                   help="comma list of arrival seeds, the same for every configuration "
                        + _preset_default(lambda p: ",".join(map(str, p.seeds))))
    p.add_argument("--interleave", action=argparse.BooleanOptionalAction, default=None,
                   help="configurations take turns seed by seed, one deployment per configuration and seed, "
                        "so machine drift spreads over all of them (default: the preset's; on in `default`)")
    p.add_argument("--num-prompts", type=positive_int, metavar="N",
                   help="requests per point " + _preset_default(lambda p: p.workload.num_prompts))
    p.add_argument("--input-len", type=positive_int, metavar="TOKENS",
                   help="prompt tokens per request " + _preset_default(lambda p: p.workload.input_len))
    p.add_argument("--output-len", type=positive_int, metavar="TOKENS",
                   help="generated tokens per request " + _preset_default(lambda p: p.workload.output_len))
    p.add_argument("--burstiness", type=check.positive_float, metavar="SHAPE",
                   help="gamma shape of inter-arrival times, 1 = Poisson (default: 1)")
    p.add_argument("--slo", action="append", metavar="NAME:SPEC", type=check.slo,
                   help="SLO, e.g. blog:ttft<1000,mean_itl<50 or stall:ttft<500,max_gap<100 (repeat; replaces the "
                        f"preset's: {', '.join(s.name for s in PRESETS['default'].slos)})")
    p.add_argument("--model", type=check.model, metavar="MODEL",
                   help="model size (tiny, small) or model directory " + _preset_default(lambda p: p.model))
    p.add_argument("--headline-rate", type=check.positive_float, metavar="RATE",
                   help="rate of the requests-meeting-SLO table and of tuning, a fraction of capacity with a "
                        "calibrated grid " + _preset_default(lambda p: f"{p.headline_rate:g}"))
    p.add_argument("--warmup-fraction", type=check.fraction, metavar="F",
                   help="share of the arrival span not scored at the start (default: 0.2)")
    p.add_argument("--cooldown-fraction", type=check.fraction, metavar="F",
                   help="share of the arrival span not scored at the end (default: 0.1)")
    p.add_argument("--tune", action="append", metavar="CONFIG=BUDGET,...", type=check.tune,
                   help="budgets to tune CONFIG over, e.g. round-robin=default,256 or adaptive=512/256,default/128 "
                        "(repeat; replaces the preset's for that CONFIG; CONFIG= alone: no tuning)")
    p.add_argument("--tune-slo", metavar="NAME",
                   help="name of the SLO whose attainment tuning maximises (default: the first)")
    p.add_argument("--target", type=check.target, metavar="F",
                   help="attainment a rate needs to count for goodput (default: 0.9)")
    chunked = p.add_mutually_exclusive_group()
    chunked.add_argument("--chunked-tokens", type=token_count, metavar="TOKENS",
                         help="fixed --max-num-batched-tokens for `chunked`, not tuned (default: 256)")
    chunked.add_argument("--chunk-candidates", type=check.budgets, metavar="TOKENS,...",
                         help="budgets to tune `chunked` over (same as --tune chunked=...)")
    p.add_argument("--out", type=Path, metavar="DIR",
                   help="results directory; alone, resumes the run there (default: a new <work dir>/runs/bench-...)")
    p.add_argument("--port", type=check.port, default=BENCH_PORT, metavar="PORT",
                   help="client-facing port of each deployment, which uses the next 9 too; keep it below the kernel's "
                        "ephemeral range, 32768+")
    p.add_argument("--report-only", action="store_true",
                   help="rewrite report and plots of the run in --out (with --slo: for those SLOs instead)")
    p.set_defaults(func=run)


def _preset_default(field) -> str:
    """`(default: X; quick: Y)`, the value each preset gives a field."""
    return "(default: " + "; ".join(f"{name} preset {field(plan)}" for name, plan in PRESETS.items()) + ")"


def build_plan(args: argparse.Namespace) -> BenchPlan:
    """The preset with the command line's overrides applied."""
    plan = preset(args.preset or "default")
    over: dict = {}
    if args.configs:
        over["configs"] = args.configs
    if args.rates:
        over["rates"], over["rate_fractions"] = args.rates, ()
        if args.headline_rate is None and plan.calibrated:
            over["headline_rate"] = max(over["rates"])
    if args.rate_fractions:
        over["rates"], over["rate_fractions"] = (), args.rate_fractions
    if args.seeds:
        over["seeds"] = args.seeds
    if args.slo:
        over["slos"] = tuple(args.slo)
    for name in ("model", "headline_rate", "target", "warmup_fraction", "cooldown_fraction", "tune_slo", "interleave"):
        if getattr(args, name) is not None:
            over[name] = getattr(args, name)
    candidates = dict(plan.candidates)
    if args.chunked_tokens is not None:
        over["chunked_tokens"] = args.chunked_tokens
        candidates.pop("chunked", None)
    if args.chunk_candidates:
        candidates["chunked"] = args.chunk_candidates
    for config, specs in args.tune or ():
        candidates[config] = specs
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


def checked_plan(args: argparse.Namespace) -> BenchPlan:
    """``build_plan`` after the rules between flags; a ConfigError names the flag and the rule (pdserve.cli
    refuses the command with it, exit 2)."""
    conflict = check.check_together(args, preset(args.preset or "default"))
    if conflict:
        raise ConfigError(conflict)
    if args.out is not None and args.out.exists() and not args.out.is_dir():
        raise ConfigError(f"--out: {args.out} is not a directory")
    return build_plan(args)


def given_plan_flags(args: argparse.Namespace) -> list[str]:
    """The flags on the command line that shape a plan (none: `--out DIR` resumes the plan stored there)."""
    return [f"--{name.replace('_', '-')}" for name in PLAN_ARGS if getattr(args, name) is not None]


def default_out(args: argparse.Namespace) -> Path:
    """A new run directory under the work directory, named after the preset and workload."""
    name = args.preset or "default"
    if args.workload and args.workload != "random":
        name += f"-{args.workload}"
    return work_dir() / "runs" / f"bench-{name}-{time.strftime('%Y%m%d-%H%M%S')}"


def drop_unregistered(plan: BenchPlan, explicit: bool) -> tuple[BenchPlan, list[str]]:
    """A preset's optional configurations (adaptive) whose launcher mode is not registered are dropped,
    with a note; asked for explicitly (--configs), they stay and the run refuses them."""
    if explicit:
        return plan, []
    deployer = LauncherDeployer()
    missing = [c for c in plan.configs if base_config(c) in OPTIONAL_CONFIGS and deployer.unavailable(c)]
    if not missing:
        return plan, []
    kept = tuple(c for c in plan.configs if c not in missing)
    notes = [f"{c}: left out, its launcher mode is not registered yet." for c in missing]
    return dataclasses.replace(plan, configs=kept, candidates=tuple(x for x in plan.candidates if x[0] in kept)), notes


def run(args: argparse.Namespace) -> int:
    if args.report_only:
        return _report_only(args)
    plan = checked_plan(args)
    from pdserve.bench.results import PlanMismatch, ResultsDir  # lazy: numpy, loaded only when a run starts

    results = ResultsDir(args.out or default_out(args))
    if args.out is not None and results.plan_path.exists() and not given_plan_flags(args):
        plan, notes = results.open_plan(None), _stored_notes(results)  # `--out DIR` alone resumes its run
    else:
        plan, dropped = drop_unregistered(plan, explicit=bool(args.configs))
        notes = [*_notes(args, plan), *dropped]
    if "nixl" in plan.configs or any(c in TWO_HOST_CONFIGS for c in plan.configs):
        ensure_nixl()  # two hosts: the KV moves over pdserve's NIXL transport
    from pdserve.model.build import resolve_model  # lazy: torch, loaded only when a run starts

    model_dir = resolve_model(plan.model)  # before the plan is stored: a model that fails blocks nothing
    try:
        plan = results.open_plan(plan)
    except PlanMismatch as exc:
        flags = sorted({PLAN_FLAGS.get(f, f) for f in exc.fields})
        raise ConfigError(f"--out: {exc.root} holds a run measured with other {', '.join(flags)}; give --out "
                          f"alone to resume it, or leave out --out for a new run") from None
    from pdserve.bench.runner import Runner, estimate_s  # lazy: scipy and matplotlib, loaded only when a run starts

    print(f"pdserve bench: {len(plan.configs)} configurations, about {estimate_s(plan) / 60:.0f} min from scratch "
          f"(estimate) -> {results.root}", file=sys.stderr)
    runner = Runner(plan, results, LauncherDeployer(port=args.port), model_dir, notes=notes)
    previous = signal.signal(signal.SIGTERM, _interrupt)  # SIGTERM unwinds like Ctrl-C: everything is stopped
    try:
        path = runner.run()
    except KeyboardInterrupt:
        print(f"\npdserve bench: interrupted; everything stopped. Resume with: pdserve bench --out {results.root}",
              file=sys.stderr)
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)
    print(path)
    return 0


def _notes(args: argparse.Namespace, plan: BenchPlan) -> list[str]:
    """The setup notes a new run's report repeats: why the preset, what was overridden, workarounds."""
    name = args.preset or "default"
    base = preset(name).to_json()
    changed = [k for k, v in plan.to_json().items() if base[k] != v]
    notes = [RATIONALE[name] + (f" Overridden here: {', '.join(changed)}." if changed else "")]
    if "nixl" in plan.configs:
        notes.append(WORKAROUNDS_NOTE)
    if any(c in TWO_HOST_CONFIGS for c in plan.configs):
        notes.append(TWO_HOST_NOTE)
    return notes


def _stored_notes(results) -> list[str]:
    return json.loads(results.notes_path.read_text()) if results.notes_path.exists() else []


def _report_only(args: argparse.Namespace) -> int:
    """Rewrite the report of the run in --out from its measured points (its own plan; --slo: other SLOs)."""
    given = given_plan_flags(args)
    if args.out is None or given:
        raise ConfigError("--report-only needs --out DIR (the run to report) and takes no plan flags"
                          + (f" (got {', '.join(given)})" if given else ""))
    from pdserve.bench.results import ResultsDir  # lazy: numpy, loaded only when a report is written
    from pdserve.bench.runner import publish  # lazy: scipy and matplotlib, loaded only when a report is written

    results = ResultsDir(args.out)
    plan = results.open_plan(None)
    added: list[str] = []
    if args.slo:  # other SLO definitions, evaluated on the same measured requests
        measured = {s.name for s in plan.slos}
        added = [s.name for s in args.slo if s.name not in measured]
        plan = dataclasses.replace(plan, slos=tuple(args.slo), tune_slo="")
    print(publish(plan, results, added_slos=added))
    return 0


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt
