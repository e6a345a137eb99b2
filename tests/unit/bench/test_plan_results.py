import pytest

from pdserve.bench.plan import BenchPlan, Point
from pdserve.bench.presets import PRESETS, preset
from pdserve.bench.results import PlanMismatch, ResultsDir
from pdserve.errors import ConfigError
from tests.unit.bench import synthetic


def test_plan_json_round_trip_and_presets():
    for plan in PRESETS.values():
        assert BenchPlan.from_json(plan.to_json()) == plan
    older = {k: v for k, v in PRESETS["default"].to_json().items() if k != "interleave"}  # a run before interleaving
    assert BenchPlan.from_json(older).interleave is False and PRESETS["default"].interleave
    with pytest.raises(ConfigError):
        preset("nope")


def test_plan_validation():
    with pytest.raises(ConfigError, match="unknown configurations"):
        synthetic.plan(configs=("collocated", "disagg"))
    with pytest.raises(ConfigError):
        synthetic.plan(rates=(1.0, 1.0))
    with pytest.raises(ConfigError):
        synthetic.plan(seeds=())


def test_points_are_grouped_by_configuration_with_rates_ascending():
    plan = synthetic.plan()
    points = plan.points()
    assert len(points) == 2 * 3 * 2 and points[0] == Point("collocated", 1.0, 1)
    assert [p.rate for p in points[:6]] == [1.0, 1.0, 2.0, 2.0, 3.0, 3.0]


def test_headline_is_highest_measured_rate_at_or_below_requested():
    assert synthetic.plan(headline_rate=2.5).headline == 2.0
    assert synthetic.plan(headline_rate=0.5).headline == 1.0


def test_results_dir_resume_rules(tmp_path):
    results = ResultsDir(tmp_path / "run")
    plan = synthetic.plan()
    with pytest.raises(ConfigError, match="nothing to resume"):
        results.open_plan(None)
    assert results.open_plan(plan) == plan
    assert results.open_plan(None) == plan  # resume reads the stored plan
    assert results.open_plan(plan) == plan
    other = synthetic.plan(seeds=(1, 2, 3))
    assert results.open_plan(other) == other  # nothing measured yet: a corrected plan replaces it
    assert results.open_plan(plan) == plan
    results.calibration_path.write_text("{}")  # measured: now the plan is fixed
    with pytest.raises(PlanMismatch, match="different plan") as refused:
        results.open_plan(other)
    assert refused.value.fields == ("seeds",)
    assert results.open_plan(plan) == plan


def test_results_dir_counts_a_measured_point(tmp_path):
    results = ResultsDir(tmp_path / "run")
    plan = synthetic.plan()
    results.open_plan(plan)
    assert not results.measured()
    point = plan.points()[0]
    results.raw_path(point).parent.mkdir(parents=True)
    synthetic.write(results.raw_path(point), synthetic.point_data(3, 0))
    assert results.measured()
    with pytest.raises(PlanMismatch):
        results.open_plan(synthetic.plan(rates=(1.0,)))


def test_point_done_only_when_raw_file_reads_back(tmp_path):
    results = ResultsDir(tmp_path)
    plan = synthetic.plan()
    point = plan.points()[0]
    assert not results.is_done(point)
    results.raw_path(point).parent.mkdir(parents=True)
    results.raw_path(point).write_text("{truncated")
    assert not results.is_done(point)
    synthetic.write(results.raw_path(point), synthetic.point_data(3, 0))
    assert results.is_done(point)
    assert list(results.load(plan)) == [point]


def test_rate_fractions_resolve_against_the_capacity_independently_of_their_order():
    plan = synthetic.plan(rates=(), rate_fractions=(1.0, 0.5), headline_rate=0.5)
    assert plan.calibrated
    resolved = plan.resolved(3.0)
    assert resolved.rates == (1.5, 3.0) and resolved.headline == 1.5 and not resolved.calibrated
    assert BenchPlan.from_json(plan.to_json()) == plan
    with pytest.raises(ConfigError, match="not both"):
        synthetic.plan(rate_fractions=(0.5,))
    with pytest.raises(ConfigError, match="too small"):
        synthetic.plan(rates=(), rate_fractions=(0.001, 0.002)).resolved(1.0)
    with pytest.raises(ConfigError, match="window"):
        synthetic.plan(warmup_fraction=0.5, cooldown_fraction=0.5)


def test_adaptive_can_declare_one_of_the_plans_slos_and_is_budgeted_as_adaptive():
    plan = synthetic.plan(configs=("round-robin", "adaptive", "adaptive@stall"),
                          candidates=(("adaptive", ("512", "512+serve")),))
    assert plan.declared_slo("adaptive@stall").spec == "ttft<1000,max_gap<100"
    assert plan.declared_slo("adaptive") is None and plan.declared_slo("round-robin") is None
    assert [str(b) for b in plan.budgets("adaptive@stall")] == ["512", "512+serve"]
    assert BenchPlan.from_json(plan.to_json()) == plan
    with pytest.raises(ConfigError, match="'tight' is none of the plan's SLOs"):
        synthetic.plan(configs=("adaptive@tight",))
    with pytest.raises(ConfigError, match="only adaptive placement declares an SLO"):
        synthetic.plan(configs=("write@blog",))
    with pytest.raises(ConfigError, match="unknown configurations"):
        synthetic.plan(configs=("smart@blog",))
