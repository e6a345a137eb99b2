"""Pairing one configuration of two bench runs request by request (pdserve bench-pair)."""

import pytest

from pdserve.bench.pairing import Side, pair, render
from pdserve.bench.plan import Point
from pdserve.bench.results import ResultsDir
from pdserve.cli import main
from pdserve.errors import ConfigError
from tests.unit.bench import synthetic

# blog attainment per (rate, seed), 10 requests each
BEFORE = {(1.0, 1): 10, (1.0, 2): 10, (2.0, 1): 6, (2.0, 2): 8}
AFTER = {(1.0, 1): 10, (1.0, 2): 10, (2.0, 1): 9, (2.0, 2): 10}


def _run(root, met, rates=(1.0, 2.0), **plan_over):
    plan = synthetic.plan(configs=("adaptive",), rates=rates, **plan_over)
    results = ResultsDir(root)
    results.open_plan(plan)
    for (rate, seed), n in met.items():
        if rate in rates:
            synthetic.write(results.raw_path(Point("adaptive", rate, seed)), synthetic.point_data(met_n=n, ttft_n=10 - n))
    return root


def test_pairs_the_same_requests_of_two_runs(tmp_path):
    before, after = _run(tmp_path / "a", BEFORE), _run(tmp_path / "b", AFTER)
    pairing = pair(Side.parse(f"{before}:adaptive=before"), Side.parse(f"{after}:adaptive=after"))
    assert pairing.num_scored == 20
    blog = {c.rate: c for c in pairing.by_slo["blog"]}
    assert blog[1.0].attainment == (1.0, 1.0) and (blog[1.0].difference.low, blog[1.0].difference.high) == (0.0, 0.0)
    assert blog[2.0].attainment == pytest.approx((0.7, 0.95))
    assert 0.0 < blog[2.0].difference.low <= 0.25 <= blog[2.0].difference.high  # after meets 5 more of 20, every block
    text = render(pairing)
    assert "| blog | 1.00 / 1.00, +0.00 [0.00, 0.00] | 0.70 / 0.95, +0.25 [" in text
    assert "| TTFT p10/p50/p90 (ms) | 1 req/s | 2 req/s |" in text and "| after | " in text


def test_pairs_goodput_and_latency_medians(tmp_path):
    before, after = _run(tmp_path / "a", BEFORE), _run(tmp_path / "b", AFTER)
    pairing = pair(Side.parse(f"{before}:adaptive=before"), Side.parse(f"{after}:adaptive=after"))
    blog = pairing.goodput["blog"]
    # before: 1.0 at 1 req/s, 0.7 at 2 -> crosses 0.9 at 1.33; after: 1.0 and 0.95 -> at least 2
    assert blog.goodput[0].value == pytest.approx(1 + 0.1 / 0.3) and blog.goodput[1].value == 2.0
    assert 0.0 <= blog.difference.low < blog.difference.high  # after never keeps less, in any resample
    ttft = pairing.medians[2.0]["TTFT"]
    assert ttft.median == (100.0, 100.0) and ttft.difference.low <= 0.0 <= ttft.difference.high
    slow = _run(tmp_path / "c", {(r, s): 0 for (r, s) in BEFORE})  # every request misses TTFT (1500 ms)
    against = pair(Side.parse(f"{after}:adaptive=after"), Side.parse(f"{slow}:adaptive=slow"))
    ttft = against.medians[1.0]["TTFT"]
    assert ttft.median == (100.0, 1500.0) and (ttft.difference.low, ttft.difference.high) == (1400.0, 1400.0)
    assert against.medians[1.0]["ITL"].median == (20.0, 20.0)
    text = render(against)
    assert "| TTFT | 100.0 / 1500.0, +1400.0 [1400.00, 1400.00] |" in text
    assert "median TTFT at 1 req/s" in text and "median ITL" not in text.split("Told apart")[1]
    assert "No difference told apart" in render(pair(Side.parse(f"{after}:adaptive"), Side.parse(f"{after}:adaptive")))


def test_compares_only_rates_both_runs_measured(tmp_path):
    before = _run(tmp_path / "a", BEFORE)
    after = _run(tmp_path / "b", AFTER, rates=(2.0, 3.0))
    pairing = pair(Side.parse(f"{before}:adaptive"), Side.parse(f"{after}:adaptive"))
    assert [c.rate for c in pairing.by_slo["blog"]] == [2.0]


def test_refuses_runs_that_did_not_send_the_same_requests(tmp_path):
    before = _run(tmp_path / "a", BEFORE)
    other = _run(tmp_path / "b", {(r, s): n for (r, s), n in AFTER.items()}, seeds=(1, 3))
    with pytest.raises(ConfigError, match="differ in seeds"):
        pair(Side.parse(f"{before}:adaptive"), Side.parse(f"{other}:adaptive"))
    with pytest.raises(ConfigError, match="no configuration 'write'"):
        pair(Side.parse(f"{before}:adaptive"), Side.parse(f"{before}:write"))
    with pytest.raises(ConfigError, match="not DIR:CONFIG"):
        Side.parse("adaptive")
    with pytest.raises(ConfigError, match="no plan.json"):
        pair(Side.parse(f"{tmp_path / 'nothing'}:adaptive"), Side.parse(f"{before}:adaptive"))


def test_bench_pair_command_prints_and_writes_the_table(tmp_path, capsys):
    before, after = _run(tmp_path / "a", BEFORE), _run(tmp_path / "b", AFTER)
    out = tmp_path / "pair.md"
    assert main(["bench-pair", f"{before}:adaptive=before", f"{after}:adaptive=after",
                 "--slo", "loose:ttft<5000", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert printed == out.read_text() and "| loose |" in printed and "| blog |" not in printed
    assert main(["bench-pair", f"{before}:adaptive", f"{tmp_path / 'missing'}:adaptive"]) == 2  # bad input
