"""The on-disk layout of one benchmark run, and which of its points are already measured.

    <dir>/plan.json                      the frozen BenchPlan
    <dir>/raw/<config>/r<rate>_s<seed>.json   vllm bench serve --save-detailed output, untouched
    <dir>/traces/r<rate>_s<seed>.jsonl   the request stream replayed at that point
    <dir>/logs/<config>/...              bench client and deployment logs
    <dir>/calibration.json               machine, measured step times, capacity (places the rates)
    <dir>/tune.json                      budget tuning of every tuned configuration
    <dir>/raw/tune/<config>/<budget>.json   the tuning points
    <dir>/placements/<config>/r<rate>_s<seed>.json   decode's placement decisions over the point
    <dir>/notes.json                     setup notes the report repeats (tuning, workarounds)
    <dir>/report.md, summary.json, plots/*.png

A point counts as done when its raw file exists and reads back; a half-written file is never
left behind (the client writes to a temporary name that is renamed on success).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pdserve.bench import placements
from pdserve.bench.calibrate import Calibration
from pdserve.bench.plan import BenchPlan, Point
from pdserve.bench.records import BenchRun, load_bench_run
from pdserve.errors import ConfigError


class PlanMismatch(ConfigError):
    """A results directory holds measurements of another plan; ``fields`` names what differs."""

    def __init__(self, root: Path, fields: tuple[str, ...]) -> None:
        super().__init__(f"{root} holds results of a different plan (it differs in {', '.join(fields)})")
        self.root, self.fields = root, fields


@dataclass(frozen=True)
class ResultsDir:
    root: Path

    @property
    def plan_path(self) -> Path:
        return self.root / "plan.json"

    @property
    def tune_path(self) -> Path:
        return self.root / "tune.json"

    @property
    def calibration_path(self) -> Path:
        return self.root / "calibration.json"

    def calibration(self) -> Calibration | None:
        """The stored calibration, if the run got that far."""
        if not self.calibration_path.exists():
            return None
        return Calibration.from_json(self.calibration_path.read_text())

    @property
    def notes_path(self) -> Path:
        return self.root / "notes.json"

    @property
    def report_path(self) -> Path:
        return self.root / "report.md"

    @property
    def plots_dir(self) -> Path:
        return self.root / "plots"

    def raw_path(self, point: Point) -> Path:
        return self.root / "raw" / point.config / f"r{point.rate:g}_s{point.seed}.json"

    def trace_path(self, point: Point) -> Path:
        """The replayed request stream (same for every configuration)."""
        return self.root / "traces" / f"r{point.rate:g}_s{point.seed}.jsonl"

    def placements_path(self, point: Point) -> Path:
        return self.root / "placements" / point.config / f"r{point.rate:g}_s{point.seed}.json"

    def placement_counts(self, plan: BenchPlan) -> dict[Point, placements.Counts]:
        """The recorded placement decisions of ``plan``'s points (points without a record are absent)."""
        return {p: placements.load(self.placements_path(p)) for p in plan.points()
                if self.placements_path(p).exists()}

    def log_dir(self, config: str) -> Path:
        return self.root / "logs" / config

    def open_plan(self, plan: BenchPlan | None) -> BenchPlan:
        """Store ``plan`` (or, resuming with None, read the stored one). A directory holding another
        plan is refused once anything of it was measured; before that the new plan replaces it, so a
        run that failed before measuring never blocks its corrected rerun."""
        stored = BenchPlan.load(self.plan_path) if self.plan_path.exists() else None
        if plan is None:
            if stored is None:
                raise ConfigError(f"{self.root} holds no plan.json: nothing to resume")
            return stored
        if stored is not None and self.measured():
            differing = [k for k, v in plan.to_json().items() if stored.to_json().get(k) != v]
            if differing:
                raise PlanMismatch(self.root, tuple(differing))
        self.root.mkdir(parents=True, exist_ok=True)
        plan.save(self.plan_path)
        return plan

    def measured(self) -> bool:
        """Whether the run measured anything yet (calibration, tuning or a point)."""
        return (self.calibration_path.exists() or self.tune_path.exists()
                or any((self.root / "raw").rglob("*.json")))

    def is_done(self, point: Point) -> bool:
        path = self.raw_path(point)
        if not path.exists():
            return False
        try:
            load_bench_run(path)
        except ConfigError:
            return False
        return True

    def load(self, plan: BenchPlan) -> dict[Point, BenchRun]:
        """Every measured point of ``plan`` (missing ones are absent from the mapping)."""
        return {p: load_bench_run(self.raw_path(p)) for p in plan.points() if self.raw_path(p).exists()}
