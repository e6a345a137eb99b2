import dataclasses

import pytest

from pdserve.bench.comparison import blocks, compare
from pdserve.bench.results import ResultsDir
from tests.unit.bench import synthetic


def measured(tmp_path, layout, num_prompts=40, configs=("collocated", "round-robin")):
    plan = synthetic.plan(configs=configs, seeds=(1, 2, 3),
                          workload=dataclasses.replace(synthetic.plan().workload, num_prompts=num_prompts))
    results = ResultsDir(tmp_path)
    for point in plan.points():
        met_n = layout(point)
        synthetic.write(results.raw_path(point), synthetic.point_data(met_n=met_n, ttft_n=num_prompts - met_n))
    return plan, results.load(plan)


def test_blocks_cover_each_seeds_window_once():
    plan = synthetic.plan(seeds=(1, 2), workload=dataclasses.replace(synthetic.plan().workload, num_prompts=20))
    cut = blocks(plan)
    assert [(s, len(b)) for s, b in cut] == [(1, 8), (1, 8), (1, 4), (2, 8), (2, 8), (2, 4)]


def test_identical_configurations_differ_by_exactly_one_in_every_paired_resample(tmp_path):
    # attainment falls with rate, with a different number of hits per seed: goodput is uncertain,
    # but both configurations served the same stream identically, so their paired ratio is exactly 1
    per_seed = {1: [40, 38, 20], 2: [40, 30, 10], 3: [40, 36, 30]}
    plan, runs = measured(tmp_path, lambda p: per_seed[p.seed][plan_rates.index(p.rate)])
    comparison = compare(plan, runs, plan.slos[0])
    ci = comparison.goodput_ci["collocated"]
    assert ci.low < ci.high  # the goodput itself has sampling noise
    assert comparison.goodput_ci["round-robin"] == ci
    ratio_ci = comparison.ratio_ci[("collocated", "round-robin")]
    assert ratio_ci.low == pytest.approx(1.0) and ratio_ci.high == pytest.approx(1.0)


def test_a_configuration_that_holds_up_longer_has_a_ratio_interval_above_one(tmp_path):
    good = {1.0: 40, 2.0: 40, 3.0: 30}  # passes at 2, not at 3
    bad = {1.0: 40, 2.0: 20, 3.0: 0}  # passes at 1 only
    plan, runs = measured(tmp_path, lambda p: (good if p.config == "collocated" else bad)[p.rate])
    comparison = compare(plan, runs, plan.slos[0])
    low = comparison.ratio_ci[("collocated", "round-robin")].low
    assert low > 1.0
    # incomplete configurations are left out; no complete one: no comparison
    partial = {p: r for p, r in runs.items() if not (p.config == "round-robin" and p.rate == 3.0)}
    assert set(compare(plan, partial, plan.slos[0]).goodput_ci) == {"collocated"}
    assert compare(plan, {}, plan.slos[0]) is None


plan_rates = [1.0, 2.0, 3.0]


def test_paired_attainment_differences_tell_configurations_apart_where_goodputs_cannot(tmp_path):
    # both below the 90 % target at every rate (goodput 0 for both), but one meets 30 of 40, the other 10
    better = {1.0: 30, 2.0: 30, 3.0: 20}
    worse = {1.0: 10, 2.0: 30, 3.0: 20}
    plan, runs = measured(tmp_path, lambda p: (better if p.config == "collocated" else worse)[p.rate])
    comparison = compare(plan, runs, plan.slos[0])
    ratio_ci = comparison.ratio_ci[("collocated", "round-robin")]
    assert not (ratio_ci.low > 1.0)  # the goodput ratio says nothing here
    at_1 = comparison.difference_ci[("collocated", "round-robin", 1.0)]
    assert 0.0 < at_1.low <= 0.5 <= at_1.high  # +0.5 on the same requests, and the interval excludes 0
    assert comparison.difference_ci[("round-robin", "collocated", 1.0)].high < 0.0
    same = comparison.difference_ci[("collocated", "round-robin", 2.0)]
    assert same.low == pytest.approx(0.0) and same.high == pytest.approx(0.0)
