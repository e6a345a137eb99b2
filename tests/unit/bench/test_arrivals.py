import numpy as np
import pytest

from pdserve.bench.arrivals import arrival_times, steady_window, unit_arrivals, unit_gaps
from pdserve.bench.plan import Workload
from pdserve.bench.trace import trace_rows
from pdserve.errors import ConfigError


def test_every_rate_replays_the_same_unit_rate_gaps_scaled():
    unit = unit_arrivals(7, 50)
    for rate in (0.5, 2.0, 3.7):
        times = arrival_times(7, 50, rate)
        np.testing.assert_allclose(times * rate, unit, rtol=1e-12)
    # the gap sequence of a seed does not depend on how many rates (or which) a plan has
    np.testing.assert_array_equal(unit_gaps(7, 50), unit_gaps(7, 50))
    assert not np.allclose(unit_gaps(7, 50), unit_gaps(8, 50))


def test_unit_gaps_have_unit_mean_and_the_burstiness_shape():
    poisson = unit_gaps(1, 20000)
    assert abs(poisson.mean() - 1) < 0.03 and abs(poisson.std() - 1) < 0.03  # exponential: sd = mean
    bursty = unit_gaps(1, 20000, burstiness=0.25)  # gamma shape k: sd = 1/sqrt(k) = 2
    assert abs(bursty.mean() - 1) < 0.1 and abs(bursty.std() - 2) < 0.15
    assert unit_arrivals(1, 5)[0] == 0.0


def test_trace_is_the_same_stream_at_every_rate():
    w = Workload(input_len=40, output_len=3, num_prompts=6)
    slow, fast = trace_rows(w, 3, 1.0), trace_rows(w, 3, 4.0)
    assert [r["hash_ids"] for r in slow] == [r["hash_ids"] for r in fast]  # same prompts
    assert [round(r["timestamp"] / 4, 6) for r in slow] == pytest.approx([r["timestamp"] for r in fast], abs=2e-6)
    assert all(len(r["hash_ids"]) == 3 and r["input_length"] == 40 and r["output_length"] == 3 for r in slow)
    ids = [i for r in slow for i in r["hash_ids"]]
    assert len(set(ids)) == len(ids)  # every prompt its own
    assert not set(ids) & {i for r in trace_rows(w, 4, 1.0) for i in r["hash_ids"]}  # seeds do not share


def test_shared_prefix_trace_shares_leading_chunks_within_a_group_only():
    w = Workload(input_len=64, output_len=3, num_prompts=40, kind="shared-prefix", prefix_len=32, num_prefixes=3)
    rows = trace_rows(w, 1, 2.0)
    prefixes = {tuple(r["hash_ids"][:2]) for r in rows}
    assert len(prefixes) == 3
    suffixes = [i for r in rows for i in r["hash_ids"][2:]]
    assert len(set(suffixes)) == len(suffixes)
    # prefix caching is on for this kind: another rate gets other prompts, the same grouping
    other = trace_rows(w, 1, 3.0)
    assert not {i for r in other for i in r["hash_ids"]} & {i for r in rows for i in r["hash_ids"]}
    assert [r["hash_ids"][0].split("-p")[1] for r in other] == [r["hash_ids"][0].split("-p")[1] for r in rows]
    with pytest.raises(ConfigError, match="shared-prefix"):
        Workload(input_len=64, output_len=3, num_prompts=4, kind="shared-prefix", prefix_len=30, num_prefixes=2)


def test_steady_window_drops_warm_up_and_cool_down_by_arrival_time():
    times = unit_arrivals(5, 100)
    window = steady_window(5, 100, 1.0, 0.2, 0.1)
    span = times[-1]
    inside = [i for i, t in enumerate(times) if 0.2 * span <= t <= 0.9 * span]
    assert list(window) == inside
    assert 55 <= len(window) <= 85  # about 70 % of 100 Poisson arrivals
    assert steady_window(5, 100, 1.0, 0.0, 0.0) == range(0, 100)
    with pytest.raises(ValueError):
        steady_window(5, 100, 1.0, 0.6, 0.5)
