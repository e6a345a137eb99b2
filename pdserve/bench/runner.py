"""The sweep: calibrate, tune, then configurations x rates x seeds, one deployment at a time, resumable.

1. Calibration (plans whose rates are fractions of capacity): a `collocated` deployment with
   vLLM's defaults is measured (calibrate.py) and the rate grid placed; calibration.json keeps it.
   Work that needs exactly that deployment (collocated's `default` tuning trial, or its points
   when it is not tuned) is done before it goes down.
2. Per configuration: each tuning candidate is deployed and sent the tuning stream (tune.py);
   the chosen budget goes to tune.json. Then the configuration is deployed with it, warmed up,
   and its missing points are run in rate order: all of them in one deployment, or, with an
   interleaved plan, one seed's in each round of deployments (BenchPlan.rounds).

A point's raw result is written only when complete, so an interrupted run resumes at the first
missing point. The report and plots are rewritten after every configuration, marked incomplete
until all points are in.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Sequence

from pdserve.bench import placements, tune
from pdserve.bench.budget import Budget, base_config
from pdserve.bench.calibrate import Calibration, calibrate, vocab_size
from pdserve.bench.deployment import Deployer, DeploymentRequest, Endpoint, check_available
from pdserve.bench.loadgen import BenchCommand, run_bench
from pdserve.bench.plan import BenchPlan, Point
from pdserve.bench.plots import write_plots
from pdserve.bench.progress import Progress
from pdserve.bench.records import load_bench_run
from pdserve.bench.report import write_report
from pdserve.bench.results import ResultsDir
from pdserve.bench.warmup import warm_up
from pdserve.errors import ConfigError, PDServeError

STARTUP_ESTIMATE_S = 75.0  # deployment up + warm-up, for estimates only
POINT_OVERHEAD_S = 20.0  # bench client start (~10-20 s of imports on 2 busy cores) and drain
CALIBRATION_S = 30.0
ASSUMED_CAPACITY = 4.0  # req/s: the estimate before a calibration exists

BenchFn = Callable[..., None]
CalibrateFn = Callable[[Endpoint, BenchPlan, Path], Calibration]


def _calibrate(endpoint: Endpoint, plan: BenchPlan, model_dir: Path) -> Calibration:
    return calibrate(endpoint, plan.workload, vocab_size(model_dir))


def default_budget(plan: BenchPlan, config: str) -> Budget:
    """The budget of a configuration that is not tuned."""
    return Budget(plan.chunked_tokens) if config == "chunked" else Budget()


def estimate_s(plan: BenchPlan, capacity: float = ASSUMED_CAPACITY) -> float:
    """Expected wall time of the whole plan from scratch (calibration, tuning, every point)."""
    resolved = plan.resolved(capacity)
    point = lambda rate: resolved.workload.num_prompts / rate + POINT_OVERHEAD_S  # noqa: E731
    total = sum(point(p.rate) for p in resolved.points()) + STARTUP_ESTIMATE_S * len(plan.rounds())
    total += sum(len(b) * (STARTUP_ESTIMATE_S + point(resolved.headline)) for c in plan.configs
                 if len(b := resolved.budgets(c)) > 1)
    if plan.calibrated:
        total += STARTUP_ESTIMATE_S + CALIBRATION_S
    return total


def resolve_stored(plan: BenchPlan, results: ResultsDir) -> BenchPlan | None:
    """The plan with its rates placed (from calibration.json); None if not calibrated yet."""
    if not plan.calibrated:
        return plan
    calibration = results.calibration()
    return plan.resolved(calibration.capacity) if calibration else None


@dataclass
class Runner:
    plan: BenchPlan
    results: ResultsDir
    deployer: Deployer
    model_dir: Path
    bench: BenchFn = run_bench
    warm: Callable[[Endpoint, BenchPlan], None] = field(
        default=lambda endpoint, plan: warm_up(endpoint, plan.workload, plan.warmup_prompts))
    notes: list[str] = field(default_factory=list)
    calibrate: CalibrateFn = _calibrate

    def run(self, progress: Progress | None = None) -> Path:
        """Measure every missing point, then write the report; returns the report's path.

        A configuration that fails (deployment unhealthy, bench client error) does not stop the
        others; the report is written anyway and PDServeError is raised at the end.
        """
        check_available(self.deployer, self.plan.configs)
        known = self.results.calibration()
        guess = self.plan.resolved(known.capacity if known else ASSUMED_CAPACITY)
        todo = [p for p in guess.points() if not (known and self.results.is_done(p))]
        progress = progress or Progress(estimate_s(self.plan, known.capacity if known else ASSUMED_CAPACITY),
                                        len(todo))
        plan = self._resolve(progress)
        failures: dict[str, str] = {}
        budgets: dict[str, Budget] = {}
        for config, seeds in plan.rounds():
            if config in failures:
                continue
            try:  # a failing configuration does not stop the others; a re-run retries it
                if config not in budgets:
                    budgets[config] = self._tuned(plan, config, progress)
                points = [p for p in plan.points()
                          if p.config == config and p.seed in seeds and not self.results.is_done(p)]
                if points:
                    with self._deployment(plan, config, budgets[config], self.results.log_dir(config),
                                          progress) as endpoint:
                        self._points(plan, endpoint, points, progress)
            except PDServeError as exc:
                failures[config] = f"{config}: {exc}"
                progress.event(f"{config} FAILED: {exc}")
            self.write_report()
        report = self.write_report()
        progress.close(f"report: {report}")
        if failures:
            raise PDServeError(f"{len(failures)} configuration(s) failed (retry: pdserve bench --out {self.results.root}): " +
                               "; ".join(failures.values()))
        return report

    def write_report(self) -> Path:
        self.results.notes_path.write_text(json.dumps(self.notes, indent=2) + "\n")
        return publish(self.plan, self.results)

    # -- calibration --------------------------------------------------------------------------

    def _resolve(self, progress: Progress) -> BenchPlan:
        stored = resolve_stored(self.plan, self.results)
        if stored is not None:
            return stored
        with self._deployment(self.plan, "collocated", Budget(), self.results.log_dir("calibration"),
                              progress) as endpoint:
            progress.event("calibrating on collocated (vLLM defaults)")
            calibration = self.calibrate(endpoint, self.plan, self.model_dir)
            self.results.calibration_path.write_text(calibration.to_json())
            plan = self.plan.resolved(calibration.capacity)
            progress.event(f"capacity {calibration.capacity:.2f} req/s: rates {', '.join(f'{r:g}' for r in plan.rates)}")
            self._reuse_calibration_deployment(plan, endpoint, progress)
        return plan

    def _reuse_calibration_deployment(self, plan: BenchPlan, endpoint: Endpoint, progress: Progress) -> None:
        """Collocated work with vLLM's defaults, done on the calibration deployment."""
        if "collocated" not in plan.configs:
            return
        budgets = plan.budgets("collocated")
        if not budgets:  # its first round's points (all of them unless interleaved)
            seeds = next(seeds for config, seeds in plan.rounds() if config == "collocated")
            points = [p for p in plan.points()
                      if p.config == "collocated" and p.seed in seeds and not self.results.is_done(p)]
            self._points(plan, endpoint, points, progress)
        elif Budget() in budgets and not self._trial_path("collocated", Budget()).exists():
            self._trial_point(plan, endpoint, "collocated", Budget(), progress)

    # -- tuning -------------------------------------------------------------------------------

    def _tuned(self, plan: BenchPlan, config: str, progress: Progress) -> Budget:
        if base_config(config) != config and base_config(config) in plan.configs and not plan.own_budgets(config):
            # adaptive@NAME without candidates of its own differs from adaptive in its declared SLO, not
            # its budget: adaptive's tuning chooses the budget of both
            return self._tuned(plan, base_config(config), progress)
        budgets = plan.budgets(config)
        if not budgets:
            return default_budget(plan, config)
        if len(budgets) == 1:  # nothing to choose between: the one budget is used as given
            return budgets[0]
        log = self._tune_log(plan)
        chosen = log.chosen(config)
        if chosen is not None:
            return chosen
        trials = []
        for budget in budgets:
            if not self._trial_path(config, budget).exists():
                log_dir = self.results.log_dir("tune") / f"{config}_{_slug(budget)}"
                with self._deployment(plan, config, budget, log_dir, progress) as endpoint:
                    self._trial_point(plan, endpoint, config, budget, progress)
            trials.append(tune.trial(plan, budget, load_bench_run(self._trial_path(config, budget))))
        best = tune.choose(trials)
        self.results.tune_path.write_text(log.with_config(config, trials, best).to_json())
        progress.event(f"{config}: tuned budget {best.budget}")
        return Budget.parse(best.budget)

    def _tune_log(self, plan: BenchPlan) -> tune.TuneLog:
        path = self.results.tune_path
        if path.exists():
            return tune.TuneLog.from_json(path.read_text())
        return tune.TuneLog(plan.headline, plan.tuning_slo.name, {})

    def _trial_path(self, config: str, budget: Budget) -> Path:
        return self.results.root / "raw" / "tune" / config / f"{_slug(budget)}.json"

    def _trial_point(self, plan: BenchPlan, endpoint: Endpoint, config: str, budget: Budget,
                     progress: Progress) -> None:
        progress.event(f"tuning {config}: budget {budget} @ {plan.headline:g} req/s")
        trace = self.results.root / "traces" / f"tune_r{plan.headline:g}.jsonl"
        command = BenchCommand(endpoint.base_url, endpoint.model_name, self.model_dir, plan.workload,
                               plan.headline, tune.TUNE_SEED, self._trial_path(config, budget), trace)
        self.bench(command, self.results.log_dir("tune") / f"bench_{config}_{_slug(budget)}.log", tick=progress.tick)
        progress.finish_work(STARTUP_ESTIMATE_S + self._point_s(plan, plan.headline))

    # -- measuring ----------------------------------------------------------------------------

    @contextlib.contextmanager
    def _deployment(self, plan: BenchPlan, config: str, budget: Budget, log_dir: Path,
                    progress: Progress) -> Iterator[Endpoint]:
        progress.event(f"{config} (budget {budget}): starting deployment")
        slo = plan.declared_slo(config)
        request = DeploymentRequest(config, self.model_dir, log_dir, budget, plan.workload.prefix_caching,
                                    slo.spec if slo is not None else None)
        with self.deployer.up(request) as endpoint:
            progress.event(f"{config}: warming up")
            self.warm(endpoint, plan)
            yield endpoint

    def _points(self, plan: BenchPlan, endpoint: Endpoint, points: Sequence[Point], progress: Progress) -> None:
        progress.finish_work(STARTUP_ESTIMATE_S)
        for point in points:
            progress.event(f"{point.config} @ {point.rate:g} req/s, seed {point.seed}")
            command = BenchCommand(endpoint.base_url, endpoint.model_name, self.model_dir, plan.workload,
                                   point.rate, point.seed, self.results.raw_path(point),
                                   self.results.trace_path(point))
            before = placements.read_counts(endpoint.instance_urls)
            self.bench(command, self.results.log_dir(point.config) / f"bench_r{point.rate:g}_s{point.seed}.log",
                       tick=progress.tick)
            after = placements.read_counts(endpoint.instance_urls)
            if endpoint.instance_urls and before is not None and after is not None:
                placements.save(self.results.placements_path(point), placements.difference(before, after))
            progress.finish_point(self._point_s(plan, point.rate))

    def _point_s(self, plan: BenchPlan, rate: float) -> float:
        return plan.workload.num_prompts / rate + POINT_OVERHEAD_S


def publish(plan: BenchPlan, results: ResultsDir, added_slos: Sequence[str] = ()) -> Path:
    """(Re)write plots and report from whatever points ``results`` holds; returns the report path.

    ``added_slos``: names of SLOs evaluated after the run (--report-only --slo), marked as such."""
    resolved = resolve_stored(plan, results)
    notes = json.loads(results.notes_path.read_text()) if results.notes_path.exists() else []
    if resolved is None:
        results.report_path.write_text("# pdserve bench report\n\nNot calibrated yet: nothing measured.\n")
        return results.report_path
    runs = results.load(resolved)
    tune_log = None
    if results.tune_path.exists():
        try:
            tune_log = tune.TuneLog.from_json(results.tune_path.read_text())
        except ConfigError as exc:  # an older run's file: its notes describe the tuning
            notes = [*notes, f"Tuning log not shown: {exc}"]
    plots = write_plots(resolved, runs, results.plots_dir)
    write_report(resolved, runs, results.report_path, notes=notes, plots=plots, calibration=results.calibration(),
                 tune_log=tune_log, placement_counts=results.placement_counts(resolved), added_slos=added_slos, rate_fractions=plan.rate_fractions,
                 headline_fraction=plan.headline_rate if plan.calibrated else None)
    return results.report_path


def _slug(budget: Budget) -> str:
    return str(budget).replace("/", "-")
