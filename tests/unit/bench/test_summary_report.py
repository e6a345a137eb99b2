import pytest

from pdserve.bench.attainment import Verdict
from pdserve.bench.goodput import Bound
from pdserve.bench.plots import write_plots
from pdserve.bench.report import write_report
from pdserve.bench.results import ResultsDir
from pdserve.bench.summary import curve, latency
from tests.unit.bench import synthetic

# attainment (blog SLO), 10 requests per point:
#   collocated  r1: 10,10  r2: 10, 8  r3: 6, 4  -> means 1.0, 0.9, 0.5
#   round-robin r1: 10,10  r2:  7, 9  r3: 2, 2  -> means 1.0, 0.8, 0.2
LAYOUT = {
    ("collocated", 1.0, 1): dict(met_n=10, ttft_n=0),
    ("collocated", 1.0, 2): dict(met_n=10, ttft_n=0),
    ("collocated", 2.0, 1): dict(met_n=5, ttft_n=0, stalled_n=5),
    ("collocated", 2.0, 2): dict(met_n=8, ttft_n=1, failed_n=1),
    ("collocated", 3.0, 1): dict(met_n=6, ttft_n=4),
    ("collocated", 3.0, 2): dict(met_n=4, ttft_n=6),
    ("round-robin", 1.0, 1): dict(met_n=10, ttft_n=0),
    ("round-robin", 1.0, 2): dict(met_n=10, ttft_n=0),
    ("round-robin", 2.0, 1): dict(met_n=7, ttft_n=0, itl_n=3),
    ("round-robin", 2.0, 2): dict(met_n=9, ttft_n=0, itl_n=1),
    ("round-robin", 3.0, 1): dict(met_n=2, ttft_n=0, itl_n=8),
    ("round-robin", 3.0, 2): dict(met_n=2, ttft_n=1, itl_n=7),
}


@pytest.fixture
def measured(tmp_path):
    plan = synthetic.plan()
    results = ResultsDir(tmp_path)
    results.open_plan(plan)
    for point in plan.points():
        synthetic.write(results.raw_path(point), synthetic.point_data(**LAYOUT[(point.config, point.rate, point.seed)]))
    return plan, results, results.load(plan)


def test_curve_attainment_ci_and_goodput(measured):
    plan, _, runs = measured
    blog, stall = plan.slos
    col = curve(plan, runs, "collocated", blog)
    at2 = col.at(2.0)
    assert [a.num_met for a in at2.per_seed] == [10, 8]
    assert at2.attainment.fraction == pytest.approx(0.9)
    # pooled 18 of 20, Wilson: centre (0.9 + z²/40) / (1 + z²/20) = 0.8356, half-width 0.1366
    assert (at2.ci.low, at2.ci.high) == pytest.approx((0.6990, 0.9721), abs=1e-4)
    assert at2.misses == {Verdict.TTFT: 1, Verdict.FAILED: 1}
    # collocated passes at 2.0 (0.9), fails at 3.0 (0.5): exactly 2.0
    assert col.goodput.value == pytest.approx(2.0) and col.goodput.bound is Bound.EXACT
    # per seed: seed 1 curve 1.0, 1.0, 0.6 -> 2 + 0.1/0.4 = 2.25; seed 2 curve 1.0, 0.8 -> 1 + 0.1/0.2 = 1.5
    assert [g.value for g in col.seed_goodputs] == pytest.approx([2.25, 1.5])
    rr = curve(plan, runs, "round-robin", blog)
    # rr mean 1.0, 0.8: 1 + 0.1/0.2 * 1 = 1.5
    assert rr.goodput.value == pytest.approx(1.5)
    assert rr.at(3.0).main_miss_cause is Verdict.ITL
    # the stalled requests pass the blog SLO but miss the stall SLO: collocated seed 1 at r2 -> 5/10
    assert curve(plan, runs, "collocated", stall).at(2.0).per_seed[0].num_met == 5


def test_latency_pools_seeds_and_excludes_failures(measured):
    plan, _, runs = measured
    lat = latency(plan, runs, "collocated", 2.0)
    assert lat.num_requests == 20 and lat.num_failed == 1
    assert lat.ttft_p50 == pytest.approx(100.0)
    assert lat.max_gap_p90 == pytest.approx(150.0)
    assert latency(plan, {}, "collocated", 2.0) is None


def test_report_and_plots(measured):
    plan, results, runs = measured
    plots = write_plots(plan, runs, results.plots_dir)
    assert [p.name for p in plots] == ["attainment_blog.png", "attainment_stall.png", "distributions_r2.png"]
    for p in plots:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 10_000
    text = write_report(plan, runs, results.report_path, notes=["a note"], plots=plots)
    assert results.report_path.read_text() == text
    assert "| collocated | 18 / 20 | 0.90 [0.70, 0.97] | failed | 1 / 0 / 0 / 1 |" in text
    assert "| round-robin | 16 / 20 | 0.80 [0.58, 0.92]" in text
    # goodput row: best plain is collocated (2.0 > 1.5); ratio to round-robin 2.0 / 1.5 = 1.33, bootstrap CIs
    row = next(line for line in text.splitlines() if line.startswith("| collocated | 2.00 ["))
    cells = [c.strip() for c in row.split("|")[1:-1]]
    assert cells[2:4] == ["2", "2.25, 1.50"] and cells[4] == "—" and cells[5] == "—"
    assert cells[6].startswith("1.33 [")
    assert "÷ best plain (collocated)" in text and "Wilson" in text
    assert "![attainment_blog](plots/attainment_blog.png)" in text
    assert "Incomplete" not in text and "- a note" in text


def test_report_marks_missing_points(measured, tmp_path):
    plan, results, runs = measured
    partial = {p: r for p, r in runs.items() if p.config == "collocated"}
    text = write_report(plan, partial, tmp_path / "partial.md")
    assert "Incomplete: 6 of 12 points" in text
    assert "| round-robin | not measured |" in text


def test_goodput_table_without_baselines_has_consistent_columns(measured, tmp_path):
    plan, _, runs = measured
    import dataclasses

    renamed = dataclasses.replace(plan, configs=("collocated",))
    only = {p: r for p, r in runs.items() if p.config == "collocated"}
    text = write_report(renamed, only, tmp_path / "one.md")
    rows = [line for line in text.splitlines() if line.startswith("| collocated | 2.00 [")]
    header = next(line for line in text.splitlines() if line.startswith("| configuration | goodput"))
    assert rows and all(row.count("|") == header.count("|") for row in rows)


def test_only_the_steady_window_is_scored(tmp_path):
    import dataclasses

    from pdserve.bench.arrivals import steady_window
    from pdserve.bench.plan import Point

    plan = dataclasses.replace(synthetic.plan(configs=("collocated",), rates=(1.0,), seeds=(1,)),
                               warmup_fraction=0.3, cooldown_fraction=0.2)
    scored = steady_window(1, 10, 1.0, 0.3, 0.2)
    assert 0 < scored.start and scored.stop < 10
    # requests outside the window meet the SLO, the scored ones all miss on TTFT
    ttfts = [100.0 if i not in scored else 1500.0 for i in range(10)]
    results = ResultsDir(tmp_path)
    synthetic.write(results.raw_path(Point("collocated", 1.0, 1)), synthetic.bench_json(ttfts, [[20.0, 20.0]] * 10))
    runs = results.load(plan)
    at = curve(plan, runs, "collocated", plan.slos[0]).at(1.0)
    assert at.num_requests == len(scored) and at.num_met == 0
    assert latency(plan, runs, "collocated", 1.0).ttft_p50 == 1500.0


def test_send_lag_is_measured_against_the_replayed_schedule(tmp_path):
    from pdserve.bench.arrivals import arrival_times
    from pdserve.bench.plan import Point
    from pdserve.bench.summary import send_lags_ms

    plan = synthetic.plan(configs=("collocated",), rates=(2.0,), seeds=(1,))
    data = synthetic.point_data(met_n=10, ttft_n=0)
    schedule = arrival_times(1, 10, 2.0)
    data["start_times"] = [1000.0 + t + (0.030 if i == 4 else 0.0) for i, t in enumerate(schedule)]
    results = ResultsDir(tmp_path)
    point = Point("collocated", 2.0, 1)
    synthetic.write(results.raw_path(point), data)
    runs = results.load(plan)
    lags = send_lags_ms(plan, point, runs[point])
    assert lags[4] == pytest.approx(30.0, abs=1e-6) and max(abs(x) for i, x in enumerate(lags) if i != 4) < 1e-6
    assert latency(plan, runs, "collocated", 2.0).send_lag_p99_ms == pytest.approx(27.3, abs=0.1)


def test_adaptive_is_compared_with_static_write_too(measured, tmp_path):
    plan, _, runs = measured
    import dataclasses

    from pdserve.bench.plan import Point

    pd = dataclasses.replace(plan, configs=("collocated", "write", "adaptive"))
    as_pd = {"round-robin": "write", "collocated": "adaptive"}  # adaptive measured like collocated, write like rr
    renamed = {Point(as_pd[p.config], p.rate, p.seed): r for p, r in runs.items()}
    renamed.update({p: r for p, r in runs.items() if p.config == "collocated"})
    text = write_report(pd, renamed, tmp_path / "pd.md")
    header = next(line for line in text.splitlines() if line.startswith("| configuration | goodput"))
    assert header.endswith("| ÷ collocated | ÷ write |")
    row = next(line for line in text.splitlines() if line.startswith("| adaptive | 2.00 ["))
    assert [c.strip() for c in row.split("|")[1:-1]][-1].startswith("1.33 [")  # 2.0 / 1.5, paired CI
    without = write_report(dataclasses.replace(pd, configs=("collocated", "write")),
                           {p: r for p, r in renamed.items() if p.config != "adaptive"}, tmp_path / "w.md")
    assert "÷ write" not in without  # static write is a baseline only beside adaptive
    # adaptive placement in READ mode is compared with static read, not write
    as_read = {"round-robin": "read", "collocated": "adaptive-read"}
    read_runs = {Point(as_read[p.config], p.rate, p.seed): r for p, r in runs.items()}
    read_runs.update({p: r for p, r in runs.items() if p.config == "collocated"})
    read = write_report(dataclasses.replace(plan, configs=("collocated", "read", "adaptive-read")), read_runs,
                        tmp_path / "r.md")
    header = next(line for line in read.splitlines() if line.startswith("| configuration | goodput"))
    assert header.endswith("| ÷ collocated | ÷ read |") and "÷ write" not in read
    assert "### Attainment minus read's, per rate" in read


def test_report_shows_paired_attainment_differences_from_the_best_plain_configuration(measured):
    plan, results, runs = measured
    text = write_report(plan, runs, results.report_path)
    lines = text.splitlines()
    start = lines.index("### Attainment minus collocated's, per rate (same requests; paired block bootstrap, 95 % CI)")
    table = lines[start:start + 6]
    # round-robin - collocated under blog: 1.0-1.0, 0.8-0.9, 0.2-0.5
    row = next(line for line in table if line.startswith("| round-robin |"))
    cells = [c.strip() for c in row.split("|")[2:-1]]
    assert cells[0].startswith("+0.00 [") and cells[1].startswith("-0.10 [") and cells[2].startswith("-0.30 [")


def test_adaptive_is_set_against_every_plain_configuration_not_only_the_best(measured, tmp_path):
    plan, _, runs = measured
    import dataclasses

    from pdserve.bench.plan import Point

    # adaptive measured like collocated (the best plain one here), so it also has a table against round-robin
    three = dataclasses.replace(plan, configs=("collocated", "round-robin", "adaptive"))
    both = dict(runs)
    both.update({Point("adaptive", p.rate, p.seed): r for p, r in runs.items() if p.config == "collocated"})
    lines = write_report(three, both, tmp_path / "three.md").splitlines()
    title = "### Attainment minus round-robin's, per rate (same requests; paired block bootstrap, 95 % CI)"
    start = lines.index(title)  # the first SLO's (blog) table
    table = lines[start:lines.index("", start + 3)]
    assert [line.split("|")[1].strip() for line in table[4:]] == ["adaptive"]  # adaptive only, not collocated
    cells = [c.strip() for c in table[4].split("|")[2:-1]]
    # adaptive - round-robin under blog: 1.0-1.0, 0.9-0.8, 0.5-0.2
    assert cells[0].startswith("+0.00 [") and cells[1].startswith("+0.10 [") and cells[2].startswith("+0.30 [")
    best = lines.index("### Attainment minus collocated's, per rate (same requests; paired block bootstrap, 95 % CI)")
    assert best < start  # the best plain configuration's table comes first, with every configuration
    plain_only = write_report(dataclasses.replace(plan, configs=("collocated", "round-robin")), runs, tmp_path / "p.md")
    # without adaptive placement, one table per SLO: the best plain configuration's
    assert sum(line.startswith("### Attainment minus") for line in plain_only.splitlines()) == len(plan.slos)
