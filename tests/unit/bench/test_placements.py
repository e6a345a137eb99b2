import contextlib
import http.server
import threading

from pdserve.bench import placements
from pdserve.bench.deployment import Endpoint
from pdserve.bench.results import ResultsDir
from tests.unit.bench import synthetic
from tests.unit.bench.test_runner import FakeBench, make

PAGE = """\
# HELP pdserve:placements_total Placement decisions of decode.
# TYPE pdserve:placements_total counter
pdserve:placements_total{{engine="0",model_name="m",placement="remote",reason="prefill_idle"}} {remote}
pdserve:placements_total{{engine="0",model_name="m",placement="local",reason="local_faster"}} {local}
pdserve:placements_created{{engine="0",model_name="m",placement="local",reason="local_faster"}} 1.7e9
vllm:request_success_total{{engine="0",finished_reason="length",model_name="m"}} 99.0
"""


@contextlib.contextmanager
def metrics_server(pages):
    """Serves /metrics: each GET answers the next page of ``pages`` (the last one repeats)."""
    served = list(pages)

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = (served.pop(0) if len(served) > 1 else served[0]).encode()
            self.send_response(200)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()
        server.server_close()


def test_counts_of_reads_only_the_placement_counter_by_placement_and_reason():
    counts = placements.counts_of(PAGE.format(remote=31.0, local=9.0))
    assert counts == {"remote:prefill_idle": 31, "local:local_faster": 9}


def test_difference_keeps_what_moved():
    before = {"remote:prefill_idle": 4, "local:local_faster": 2}
    after = {"remote:prefill_idle": 10, "local:local_faster": 2, "local:ttft_rescue": 3}
    assert placements.difference(before, after) == {"local:ttft_rescue": 3, "remote:prefill_idle": 6}


def test_read_counts_sums_instances_and_answers_none_when_one_is_unreachable():
    with metrics_server([PAGE.format(remote=3, local=1)]) as a, metrics_server([PAGE.format(remote=2, local=0)]) as b:
        assert placements.read_counts([a, b]) == {"remote:prefill_idle": 5, "local:local_faster": 1}
        assert placements.read_counts([a, "http://127.0.0.1:1"], timeout_s=2) is None


def test_section_shows_shares_and_reasons_and_leaves_out_configurations_without_decisions():
    lines = placements.section([("round-robin", 0.5, {}),
                                ("adaptive", 0.5, {"remote:prefill_idle": 30, "local:local_faster": 10})])
    table = "\n".join(lines)
    assert "round-robin" not in table
    assert "| adaptive | 0.5 | 40 | 30 (75%) | 10 (25%) | — | remote:prefill_idle 30, local:local_faster 10 |" in table
    assert placements.section([("round-robin", 0.5, {})]) == []


def test_section_shows_the_chunk_steps_over_their_bound_apart_from_the_decisions():
    counts = {"remote:prefill_idle": 30, "local:local_faster": 10, "chunk_step:within": 57, "chunk_step:over": 3}
    [row] = [line for line in placements.section([("adaptive", 0.5, counts)]) if line.startswith("| adaptive")]
    assert row == "| adaptive | 0.5 | 40 | 30 (75%) | 10 (25%) | 3 of 60 (5%) | remote:prefill_idle 30, local:local_faster 10 |"


def test_counts_of_reads_decisions_and_chunk_steps_from_one_metrics_page():
    text = "\n".join([
        '# TYPE pdserve:placements_total counter',
        'pdserve:placements_total{engine="0",placement="local",reason="local_faster"} 4.0',
        '# TYPE pdserve:local_chunk_steps_total counter',
        'pdserve:local_chunk_steps_total{bound="within",engine="0"} 40.0',
        'pdserve:local_chunk_steps_total{bound="over",engine="0"} 2.0',
        'vllm:num_requests_running{engine="0"} 3.0'])
    assert placements.counts_of(text) == {"local:local_faster": 4, "chunk_step:within": 40, "chunk_step:over": 2}


class MetricsDeployer:
    """Brings up nothing; its endpoint names a /metrics server as the deployment's one instance."""

    def __init__(self, url):
        self.url = url

    def unavailable(self, config):
        return None

    @contextlib.contextmanager
    def up(self, request):
        yield Endpoint("http://127.0.0.1:1", "m", (self.url,))


def test_the_runner_records_each_points_decisions_and_the_report_shows_them(tmp_path, monkeypatch):
    monkeypatch.setattr("pdserve.bench.runner.write_plots", lambda plan, runs, out_dir: [])
    plan = synthetic.plan(configs=("adaptive",))
    # every point moves the counters by 3 remote and 1 local decisions
    pages = [PAGE.format(remote=3 * (i // 2 + i % 2), local=i // 2 + i % 2) for i in range(2 * len(plan.points()))]
    with metrics_server(pages) as url:
        runner, progress = make(tmp_path, plan, MetricsDeployer(url), FakeBench())
        report = runner.run(progress).read_text()
    results = ResultsDir(tmp_path / "run")
    recorded = results.placement_counts(plan)
    assert set(recorded) == set(plan.points())
    assert all(c == {"remote:prefill_idle": 3, "local:local_faster": 1} for c in recorded.values())
    seeds = len(plan.seeds)
    assert f"| adaptive | {min(plan.rates):g} | {4 * seeds} | {3 * seeds} (75%) | {seeds} (25%) |" in report
