import json

import pytest

from pdserve.bench.records import RequestRecord, load_bench_run, records_from_bench
from pdserve.errors import ConfigError
from pdserve.slo import Metric


def _detail(**over):
    data = {
        "duration": 10.0,
        "request_throughput": 0.3,
        "output_throughput": 3.0,
        "ttfts": [0.2, 0.5, 0.0],
        "itls": [[0.01, 0.03, 0.02], [], []],
        "errors": ["", "", "Traceback: connection reset"],
        "output_lens": [4, 1, 0],
        "input_lens": [100, 100, 100],
    }
    data.update(over)
    return data


def test_records_convert_to_ms_and_mark_failures():
    first, single, failed = records_from_bench(_detail())
    assert first.ttft_ms == pytest.approx(200.0)
    assert first.itl_ms == pytest.approx((10.0, 30.0, 20.0))
    assert first.mean_itl_ms == pytest.approx(20.0)
    assert first.max_gap_ms == pytest.approx(30.0)
    assert first.value(Metric.MAX_GAP) == pytest.approx(30.0)
    assert not first.failed and not single.failed
    assert single.mean_itl_ms == 0.0 and single.max_gap_ms == 0.0
    assert failed.failed and "connection reset" in failed.error


def test_empty_error_with_no_output_is_a_failure():
    data = _detail(errors=["", "", ""], output_lens=[4, 0, 3])
    assert [r.failed for r in records_from_bench(data)] == [False, True, False]


def test_missing_detail_is_rejected():
    data = _detail()
    del data["itls"]
    with pytest.raises(ConfigError, match="save-detailed"):
        records_from_bench(data)


def test_load_bench_run(tmp_path):
    path = tmp_path / "r.json"
    path.write_text(json.dumps(_detail()))
    run = load_bench_run(path)
    assert len(run.records) == 3 and run.num_failed == 1
    assert run.duration_s == 10.0 and run.output_throughput == 3.0
    with pytest.raises(ConfigError):
        load_bench_run(tmp_path / "absent.json")


def test_record_is_frozen():
    record = RequestRecord(ttft_ms=1.0, itl_ms=(), failed=False)
    with pytest.raises(AttributeError):
        record.ttft_ms = 2.0


def test_outputs_short_of_the_requested_length_are_counted():
    from pdserve.bench.records import BenchRun
    from tests.unit.bench import synthetic

    data = synthetic.bench_json([100.0, 100.0, 100.0], [[20.0, 20.0, 20.0], [20.0], [20.0, 20.0, 20.0]], failed={2})
    run = BenchRun(records_from_bench(data), 1.0, 1.0, 1.0)
    # output lengths 4, 2 and a failure: one short of 4 tokens (the failure counts as failed, not short)
    assert run.num_short(4) == 1 and run.num_short(2) == 0 and run.num_failed == 1
