import contextlib
import dataclasses
import json

import pytest

from pdserve.bench.deployment import Endpoint, check_available
from pdserve.bench.progress import Progress
from pdserve.bench.results import ResultsDir
from pdserve.bench.runner import Runner, estimate_s
from pdserve.errors import ConfigError
from tests.unit.bench import synthetic


class FakeDeployer:
    def __init__(self, missing=()):
        self.missing = set(missing)
        self.log = []

    def unavailable(self, config):
        return "not registered" if config in self.missing else None

    @contextlib.contextmanager
    def up(self, request):
        self.log.append(("up", request.config, request.budget))
        try:
            yield Endpoint("http://127.0.0.1:1", "m")
        finally:
            self.log.append(("down", request.config))


class FakeBench:
    """Writes a synthetic result whose attainment depends on the budget (for tuning) or rate."""

    def __init__(self, interrupt_at=None):
        self.commands = []
        self.interrupt_at = interrupt_at

    def __call__(self, command, log_path, tick):
        if self.interrupt_at is not None and len(self.commands) == self.interrupt_at:
            raise KeyboardInterrupt
        self.commands.append(command)
        tick(0.5)
        synthetic.write(command.result_path, synthetic.point_data(met_n=10, ttft_n=0))


@pytest.fixture
def no_plots(monkeypatch):
    """Plots are checked elsewhere; drawing them after every configuration is slow."""
    monkeypatch.setattr("pdserve.bench.runner.write_plots", lambda plan, runs, out_dir: [])


def make(tmp_path, plan, deployer, bench):
    results = ResultsDir(tmp_path / "run")
    results.open_plan(plan)
    progress = Progress(100.0, len(plan.points()), stream=open(tmp_path / "progress.txt", "w"))
    return Runner(plan, results, deployer, tmp_path, bench=bench, warm=lambda e, p: None), progress


def test_runs_every_point_once_per_deployment_and_reports(tmp_path):
    plan = synthetic.plan()
    deployer, bench = FakeDeployer(), FakeBench()
    runner, progress = make(tmp_path, plan, deployer, bench)
    report = runner.run(progress)
    assert [e[:2] for e in deployer.log] == [("up", "collocated"), ("down", "collocated"),
                                              ("up", "round-robin"), ("down", "round-robin")]
    assert len(bench.commands) == 12
    seeds = {(c.rate, c.seed) for c in bench.commands}
    assert len(seeds) == 6  # bench seeds repeat across configs, not within one
    assert "Incomplete" not in report.read_text()
    assert (tmp_path / "run" / "plots" / "attainment_blog.png").exists()
    assert "12/12 points" in (tmp_path / "progress.txt").read_text()


def test_an_interleaved_plan_runs_seed_by_seed_rotating_the_configurations(tmp_path, no_plots):
    plan = synthetic.plan(configs=("collocated", "round-robin", "write"), seeds=(1, 2, 3), interleave=True,
                          candidates=(("write", ("default", "512")),))
    deployer, bench = FakeDeployer(), FakeBench()
    runner, progress = make(tmp_path, plan, deployer, bench)
    report = runner.run(progress).read_text()
    measured = [(c.result_path.parent.name, c.seed) for c in bench.commands if "tune" not in c.result_path.parts]
    rounds = [measured[i:i + 3] for i in range(0, len(measured), 3)]  # three rates per deployment
    assert [r[0] for r in rounds] == [("collocated", 1), ("round-robin", 1), ("write", 1),
                                      ("round-robin", 2), ("write", 2), ("collocated", 2),
                                      ("write", 3), ("collocated", 3), ("round-robin", 3)]
    assert all(len(set(r)) == 1 for r in rounds)  # one seed of one configuration per deployment
    ups = [(e[1], str(e[2])) for e in deployer.log if e[0] == "up"]
    # write is tuned once, before its first round; every later deployment uses the chosen budget
    chosen = json.loads((tmp_path / "run" / "tune.json").read_text())["configs"]["write"]["chosen"]
    assert ups[2:4] == [("write", "default"), ("write", "512")]
    assert [u for u in ups[4:] if u[0] == "write"] == [("write", chosen)] * 3
    assert len(ups) == 9 + 2 and "Order: interleaved, seed by seed" in report
    assert estimate_s(plan) > estimate_s(dataclasses.replace(plan, interleave=False))


def test_interrupt_stops_the_deployment_and_resume_runs_only_missing_points(tmp_path, no_plots):
    plan = synthetic.plan()
    deployer = FakeDeployer()
    runner, progress = make(tmp_path, plan, deployer, FakeBench(interrupt_at=8))
    with pytest.raises(KeyboardInterrupt):
        runner.run(progress)
    assert deployer.log[-1] == ("down", "round-robin")
    bench = FakeBench()
    runner, progress = make(tmp_path, plan, FakeDeployer(), bench)
    runner.run(progress)
    assert len(bench.commands) == 4  # 12 points - 8 done
    assert {c.result_path.parent.name for c in bench.commands} == {"round-robin"}
    # a third run has nothing to do and starts no deployment
    deployer = FakeDeployer()
    runner, progress = make(tmp_path, plan, deployer, FakeBench())
    runner.run(progress)
    assert deployer.log == []


def test_unavailable_configuration_is_an_error_before_anything_starts(tmp_path, no_plots):
    plan = synthetic.plan(configs=("collocated", "write", "read"))
    deployer = FakeDeployer(missing=("write", "read"))
    runner, progress = make(tmp_path, plan, deployer, FakeBench())
    with pytest.raises(ConfigError, match="write: not registered; read: not registered"):
        runner.run(progress)
    assert deployer.log == []
    check_available(FakeDeployer(), plan.configs)


def test_every_tuned_configuration_gets_the_same_procedure_and_its_chosen_budget(tmp_path, no_plots):
    plan = synthetic.plan(configs=("round-robin", "write"),
                          candidates=(("round-robin", ("default", "256")), ("write", ("default", "512/256"))))
    deployer = FakeDeployer()
    streams = []

    def bench(command, log_path, tick):
        if "tune" in command.result_path.parts:
            streams.append((command.seed, command.rate, command.trace_path))
            # 256 / 512-256 meet the SLO, vLLM's default misses it on TTFT
            good = command.result_path.stem != "default"
            data = synthetic.point_data(met_n=10, ttft_n=0) if good else synthetic.point_data(met_n=2, ttft_n=8)
        else:
            data = synthetic.point_data(met_n=10, ttft_n=0)
        synthetic.write(command.result_path, data)

    runner, progress = make(tmp_path, plan, deployer, bench)
    runner.run(progress)
    ups = [(e[1], str(e[2])) for e in deployer.log if e[0] == "up"]
    assert ups == [("round-robin", "default"), ("round-robin", "256"), ("round-robin", "256"),
                   ("write", "default"), ("write", "512/256"), ("write", "512/256")]
    assert len(set(streams)) == 1 and len(streams) == 4  # one tuning stream for every candidate and configuration
    tuned = json.loads((tmp_path / "run" / "tune.json").read_text())
    assert tuned["configs"]["round-robin"]["chosen"] == "256" and tuned["configs"]["write"]["chosen"] == "512/256"
    assert tuned["rate"] == plan.headline and "objective" in tuned
    report = (tmp_path / "run" / "report.md").read_text()
    assert "round-robin: budget 256 (tried default: 0.20, 256: 1.00)" in report
    # resumed with everything done: no deployment, no tuning, the tuning stays in the report
    deployer = FakeDeployer()
    runner, progress = make(tmp_path, plan, deployer, bench)
    runner.run(progress)
    assert deployer.log == []
    assert "write: budget 512/256" in (tmp_path / "run" / "report.md").read_text()


def test_a_single_candidate_is_used_as_given_without_a_tuning_point(tmp_path, no_plots):
    plan = synthetic.plan(configs=("write",), candidates=(("write", ("512",)),))
    deployer, bench = FakeDeployer(), FakeBench()
    runner, progress = make(tmp_path, plan, deployer, bench)
    runner.run(progress)
    assert [(e[1], str(e[2])) for e in deployer.log if e[0] == "up"] == [("write", "512")]
    assert not any("tune" in c.result_path.parts for c in bench.commands)
    assert "Fixed budget (one candidate, not tuned): write 512." in (tmp_path / "run" / "report.md").read_text()


def test_calibration_places_the_rates_and_its_deployment_measures_untuned_collocated(tmp_path, no_plots):
    from pdserve.bench.calibrate import Calibration, Machine

    plan = synthetic.plan(rates=(), rate_fractions=(0.5, 1.0), headline_rate=1.0)
    calls = []

    def calibrate(endpoint, plan_, model_dir):
        calls.append(endpoint)
        # marginal step (20 - 10) / 7 = 1.4286 ms; capacity 1000 / (100 + 4 x 1.4286) = 9.46 req/s
        return Calibration(Machine("Test CPU", 2, 2, "3.11"), "collocated", 64, 4, 100.0, 10.0, 20.0, 8)

    deployer, bench = FakeDeployer(), FakeBench()
    runner, progress = make(tmp_path, plan, deployer, bench)
    runner.calibrate = calibrate
    runner.run(progress)
    assert len(calls) == 1
    assert sorted({c.rate for c in bench.commands}) == [4.73, 9.46]
    assert [e[:2] for e in deployer.log if e[0] == "up"] == [("up", "collocated"), ("up", "round-robin")]
    report = (tmp_path / "run" / "report.md").read_text()
    assert "Test CPU, 2 usable of 2 CPUs" in report and "9.46 req/s" in report
    assert "Rates: 0.5, 1 x the estimated capacity" in report
    runner, progress = make(tmp_path, plan, FakeDeployer(), FakeBench())
    runner.calibrate = calibrate
    runner.run(progress)
    assert len(calls) == 1  # stored in calibration.json


def test_a_failing_configuration_does_not_stop_the_others(tmp_path, no_plots):
    from pdserve.errors import LaunchError, PDServeError

    class Flaky(FakeDeployer):
        @contextlib.contextmanager
        def up(self, request):
            if request.config == "collocated":
                raise LaunchError("vllm exited with code 1 during start")
            with super().up(request) as endpoint:
                yield endpoint

    plan = synthetic.plan()
    deployer, bench = Flaky(), FakeBench()
    runner, progress = make(tmp_path, plan, deployer, bench)
    with pytest.raises(PDServeError, match="collocated: vllm exited"):
        runner.run(progress)
    assert len(bench.commands) == 6
    assert "Incomplete: 6 of 12 points" in (tmp_path / "run" / "report.md").read_text()


def test_expect_model_refuses_a_foreign_deployment(tmp_path):
    import http.server
    import threading

    from pdserve.bench.deployment import expect_model
    from pdserve.errors import LaunchError

    class Models(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = json.dumps({"data": [{"id": str(tmp_path / "ours")}]}).encode()
            self.send_response(200)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Models)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_port}"
        assert expect_model(url, tmp_path / "ours") == str(tmp_path / "ours")
        with pytest.raises(LaunchError, match="another deployment"):
            expect_model(url, tmp_path / "theirs")
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def test_adaptive_declaring_an_slo_is_deployed_with_it_and_named_in_the_report(tmp_path, no_plots):
    plan = synthetic.plan(configs=("adaptive", "adaptive@stall"), candidates=(("adaptive", ("512",)),))
    requests = []

    class Recording(FakeDeployer):
        @contextlib.contextmanager
        def up(self, request):
            requests.append(request)
            with super().up(request) as endpoint:
                yield endpoint

    runner, progress = make(tmp_path, plan, Recording(), FakeBench())
    runner.run(progress)
    assert [(r.config, r.mode, r.slo, str(r.budget)) for r in requests if "tune" not in r.log_dir.parts] == [
        ("adaptive", "adaptive", None, "512"), ("adaptive@stall", "adaptive", "ttft<1000,max_gap<100", "512")]
    assert requests[1].up_options(18800, 60).slo == "ttft<1000,max_gap<100"
    assert "`adaptive@stall` declares `ttft<1000,max_gap<100`" in (tmp_path / "run" / "report.md").read_text()


def test_adaptive_declaring_an_slo_takes_the_budget_adaptive_was_tuned_to(tmp_path, no_plots):
    plan = synthetic.plan(configs=("adaptive@stall", "adaptive"), candidates=(("adaptive", ("512", "512+serve")),))
    deployer = FakeDeployer()

    def bench(command, log_path, tick):  # +serve meets the SLO in tuning, 512 does not
        good = "tune" not in command.result_path.parts or command.result_path.stem != "512"
        synthetic.write(command.result_path, synthetic.point_data(met_n=10 if good else 2, ttft_n=0 if good else 8))

    runner, progress = make(tmp_path, plan, deployer, bench)
    runner.run(progress)
    ups = [(e[1], str(e[2])) for e in deployer.log if e[0] == "up"]
    assert ups == [("adaptive", "512"), ("adaptive", "512+serve"),  # tuned once, on adaptive's own deployments
                   ("adaptive@stall", "512+serve"), ("adaptive", "512+serve")]
    assert "uses the budget its tuning chose" in (tmp_path / "run" / "report.md").read_text()


def test_adaptive_declaring_an_slo_with_budgets_of_its_own_is_deployed_with_them(tmp_path, no_plots):
    # `--tune adaptive=512+serve --tune adaptive@blog=512`: a paired comparison of +serve within one run
    plan = synthetic.plan(configs=("adaptive", "adaptive@stall"),
                          candidates=(("adaptive", ("512+serve",)), ("adaptive@stall", ("512",))))
    deployer = FakeDeployer()
    runner, progress = make(tmp_path, plan, deployer, FakeBench())
    runner.run(progress)
    ups = [(e[1], str(e[2])) for e in deployer.log if e[0] == "up"]
    assert ups == [("adaptive", "512+serve"), ("adaptive@stall", "512")]
    assert [str(b) for b in plan.own_budgets("adaptive@stall")] == ["512"] and plan.own_budgets("adaptive@blog") == ()
    assert "Fixed budget (one candidate, not tuned): adaptive 512+serve, adaptive@stall 512." in \
        (tmp_path / "run" / "report.md").read_text()
