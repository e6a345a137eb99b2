"""The sweep: configurations x rates x seeds, one deployment at a time, resumable.

For each configuration with unmeasured points: bring it up through the deployer, warm it up,
run its missing points in rate order, tear it down; then the next configuration on the same
cores. A point's raw result is written only when complete, so an interrupted run resumes at the
first missing point (``pdserve bench --resume --out DIR``). The report and plots are rewritten
after every configuration, marked incomplete until all points are in.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from pdserve.bench import tune
from pdserve.bench.deployment import Deployer, DeploymentRequest, Endpoint, check_available
from pdserve.bench.loadgen import BenchCommand, run_bench
from pdserve.bench.plan import BenchPlan, Point
from pdserve.bench.plots import write_plots
from pdserve.bench.progress import Progress
from pdserve.bench.records import load_bench_run
from pdserve.bench.report import write_report
from pdserve.bench.results import ResultsDir
from pdserve.bench.warmup import warm_up
from pdserve.errors import PDServeError

STARTUP_ESTIMATE_S = 75.0  # deployment up + warm-up, for the progress estimate only
POINT_OVERHEAD_S = 15.0  # bench client start (~10 s import) and drain

BenchFn = Callable[..., None]


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

    def run(self, progress: Progress | None = None) -> Path:
        """Measure every missing point, then write the report; returns the report's path.

        A configuration that fails (deployment unhealthy, bench client error) does not stop the
        others; the report is written anyway and PDServeError is raised at the end.
        """
        check_available(self.deployer, self.plan.configs)
        todo = [p for p in self.plan.points() if not self.results.is_done(p)]
        progress = progress or Progress(self.estimate_s(todo), len(todo))
        failures = []
        for config in self.plan.configs:
            points = [p for p in todo if p.config == config]
            if not points:
                continue
            try:  # a failing configuration does not stop the others; a re-run retries it
                extra = ("--max-num-batched-tokens", str(self._chunk_budget(progress))) if config == "chunked" else ()
                self._measure(config, points, extra, progress)
            except PDServeError as exc:
                failures.append(f"{config}: {exc}")
                progress.event(f"{config} FAILED: {exc}")
            self.write_report()
        report = self.write_report()
        progress.close(f"report: {report}")
        if failures:
            raise PDServeError(f"{len(failures)} configuration(s) failed (re-run to retry): " + "; ".join(failures))
        return report

    def estimate_s(self, todo: list[Point]) -> float:
        configs = {p.config for p in todo}
        work = sum(self._point_s(p.rate) for p in todo) + STARTUP_ESTIMATE_S * len(configs)
        if "chunked" in configs and not self.results.tune_path.exists():
            work += len(self.plan.chunk_candidates) * (STARTUP_ESTIMATE_S + self._point_s(self.plan.headline))
        return work

    def write_report(self) -> Path:
        notes = [*self.notes, *filter(None, [self._chunk_note()])]
        self.results.notes_path.write_text(json.dumps(notes, indent=2) + "\n")
        return publish(self.plan, self.results)

    def _point_s(self, rate: float) -> float:
        return self.plan.workload.num_prompts / rate + POINT_OVERHEAD_S

    def _measure(self, config: str, points: list[Point], extra: tuple[str, ...], progress: Progress) -> None:
        progress.event(f"{config}: starting deployment")
        request = DeploymentRequest(config, self.model_dir, self.results.log_dir(config), extra)
        with self.deployer.up(request) as endpoint:
            progress.event(f"{config}: warming up")
            self.warm(endpoint, self.plan)
            progress.finish_work(STARTUP_ESTIMATE_S)
            for point in points:
                progress.event(f"{config} @ {point.rate:g} req/s, seed {point.seed}")
                command = BenchCommand(endpoint.base_url, endpoint.model_name, self.model_dir, self.plan.workload,
                                       point.rate, point.seed, self.results.raw_path(point),
                                       self.results.trace_path(point))
                self.bench(command, self.results.log_dir(config) / f"bench_r{point.rate:g}_s{point.seed}.log",
                           tick=progress.tick)
                progress.finish_point(self._point_s(point.rate))

    def _chunk_budget(self, progress: Progress) -> int:
        """The chunked configuration's token budget: tuned once (tune.json), else the plan's value."""
        if not self.plan.chunk_candidates:
            return self.plan.chunked_tokens
        if not self.results.tune_path.exists():
            trials = [self._chunk_trial(budget, progress) for budget in self.plan.chunk_candidates]
            self.results.tune_path.write_text(tune.to_json(trials, tune.choose(self.plan, trials)))
        return tune.chosen_from_json(self.results.tune_path.read_text())

    def _chunk_note(self) -> str | None:
        if "chunked" not in self.plan.configs:
            return None
        if not self.plan.chunk_candidates:
            return f"chunked: --max-num-batched-tokens {self.plan.chunked_tokens} (fixed by the plan)."
        if not self.results.tune_path.exists():
            return None
        chosen = tune.chosen_from_json(self.results.tune_path.read_text())
        return (f"chunked: --max-num-batched-tokens {chosen}, tuned over {list(self.plan.chunk_candidates)} at "
                f"{self.plan.headline:g} req/s (least p90 max gap among budgets keeping TTFT attainment >= "
                f"{self.plan.target:.0%}; trials in tune.json).")

    def _chunk_trial(self, budget: int, progress: Progress) -> tune.ChunkTrial:
        name = f"chunk{budget}"
        raw = self.results.root / "raw" / "tune" / f"{name}.json"
        if not raw.exists():
            progress.event(f"tuning chunked: --max-num-batched-tokens {budget}")
            log_dir = self.results.log_dir("tune")
            request = DeploymentRequest("chunked", self.model_dir, log_dir / name,
                                        ("--max-num-batched-tokens", str(budget)))
            with self.deployer.up(request) as endpoint:
                self.warm(endpoint, self.plan)
                command = BenchCommand(endpoint.base_url, endpoint.model_name, self.model_dir, self.plan.workload,
                                       self.plan.headline, tune.TUNE_SEED, raw,
                                       raw.with_suffix(".trace.jsonl"))
                self.bench(command, log_dir / f"bench_{name}.log", tick=progress.tick)
        progress.finish_work(STARTUP_ESTIMATE_S + self._point_s(self.plan.headline))
        return tune.trial(self.plan, budget, load_bench_run(raw))


def publish(plan: BenchPlan, results: ResultsDir) -> Path:
    """(Re)write plots and report from whatever points ``results`` holds; returns the report path."""
    runs = results.load(plan)
    notes = json.loads(results.notes_path.read_text()) if results.notes_path.exists() else []
    plots = write_plots(plan, runs, results.plots_dir)
    write_report(plan, runs, results.report_path, notes=notes, plots=plots)
    return results.report_path
