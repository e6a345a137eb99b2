import pytest

from pdserve.bench.attainment import Verdict, attainment, judge
from pdserve.bench.records import RequestRecord
from pdserve.slo import SLO

BLOG = SLO.parse("blog:ttft<1000,mean_itl<50")
STALL = SLO.parse("stall:ttft<1000,max_gap<200")


def rec(ttft, itls, failed=False):
    return RequestRecord(ttft_ms=ttft, itl_ms=tuple(itls), failed=failed)


def test_judge_each_cause():
    assert judge(rec(999, [40, 59]), BLOG) is Verdict.MET
    assert judge(rec(1000, [10]), BLOG) is Verdict.TTFT  # strict <
    assert judge(rec(10, [40, 61]), BLOG) is Verdict.ITL
    assert judge(rec(2000, [100]), BLOG) is Verdict.BOTH
    assert judge(rec(10, [10]), SLO.parse("ttft<1")) is Verdict.TTFT
    assert judge(rec(10, [10], failed=True), BLOG) is Verdict.FAILED


def test_mean_itl_boundary_is_strict():
    assert judge(rec(10, [40, 60]), BLOG) is Verdict.ITL


def test_max_gap_slo_sees_a_stall_that_mean_itl_hides():
    stalled = rec(300, [20] * 30 + [250])  # mean 27.4 ms, one 250 ms stall
    assert judge(stalled, BLOG) is Verdict.MET
    assert judge(stalled, STALL) is Verdict.ITL


def test_attainment_counts_failures_as_misses():
    records = [
        rec(100, [20, 30]),  # met
        rec(200, [45, 50]),  # met (47.5)
        rec(1500, [20]),  # ttft
        rec(1200, [30]),  # ttft
        rec(100, [80]),  # itl
        rec(0, [], failed=True),  # failed
        rec(100, [10]),  # met
        rec(100, [10]),  # met
    ]
    result = attainment(records, BLOG)
    assert result.num_requests == 8 and result.num_met == 4
    assert result.fraction == pytest.approx(0.5)
    assert result.misses == {Verdict.TTFT: 2, Verdict.ITL: 1, Verdict.FAILED: 1}
    assert result.main_miss_cause is Verdict.TTFT


def test_main_miss_cause_ties_prefer_failed_and_none_without_misses():
    tie = attainment([rec(0, [], failed=True), rec(5000, [1])], BLOG)
    assert tie.main_miss_cause is Verdict.FAILED
    clean = attainment([rec(1, [1])], BLOG)
    assert clean.fraction == 1.0 and clean.main_miss_cause is None
    assert attainment([], BLOG).fraction == 0.0
