import argparse

import pytest

from pdserve.bench import cli, tune
from pdserve.bench.budget import Budget
from pdserve.errors import ConfigError
from pdserve.slo import SLO
from tests.unit.bench import synthetic


def trial(budget, att, mean_att=0.5, ttft=100.0):
    return tune.Trial(budget, att, mean_att, ttft, 20.0, 10)


def test_choose_maximises_the_tuning_slo_then_mean_attainment_then_ttft():
    assert tune.choose([trial("default", 0.5), trial("256", 0.9), trial("512", 0.8)]).budget == "256"
    assert tune.choose([trial("default", 0.9, 0.6), trial("256", 0.9, 0.8)]).budget == "256"
    assert tune.choose([trial("default", 0.9, 0.8, 300.0), trial("256", 0.9, 0.8, 200.0)]).budget == "256"
    assert tune.choose([trial("default", 0.0, 0.0, float("nan")), trial("256", 0.0, 0.0, 900.0)]).budget == "256"


def test_trial_scores_the_steady_window_against_the_tuning_slo(tmp_path):
    from pdserve.bench.records import load_bench_run

    path = tmp_path / "t.json"
    synthetic.write(path, synthetic.point_data(met_n=5, ttft_n=5))
    plan = synthetic.plan(tune_slo="stall")
    t = tune.trial(plan, Budget(128), load_bench_run(path))
    assert t.budget == "128" and t.attainment == 0.5 and t.max_gap_p90_ms == pytest.approx(20.0)


def test_tune_log_round_trip():
    log = tune.TuneLog(2.0, "blog", {}).with_config("write", [trial("default", 0.5), trial("512", 0.9)],
                                                     trial("512", 0.9))
    back = tune.TuneLog.from_json(log.to_json())
    assert back.chosen("write") == Budget(512) and back.chosen("read") is None
    assert back.describe("write") == "write: budget 512 (tried default: 0.50, 512: 0.90)"


def test_budget_specs():
    assert Budget.parse("default") == Budget() and Budget.parse("256") == Budget(256)
    assert Budget.parse("512/128") == Budget(512, 128) and Budget.parse("default/256") == Budget(None, 256)
    assert str(Budget(None, 256)) == "default/256"
    for bad in ("x", "1/2/3", "8", "512/"):
        with pytest.raises(ConfigError):
            Budget.parse(bad)
    with pytest.raises(ConfigError, match="no decode instance"):
        synthetic.plan(candidates=(("collocated", ("512/256",)),))


def parse(*argv):
    parser = argparse.ArgumentParser()
    cli.add_parser(parser.add_subparsers())
    return parser.parse_args(["bench", *argv])


def test_cli_overrides_the_preset():
    args = parse("--quick", "--configs", "collocated,nixl", "--rates", "1,2.5", "--seeds", "3,4",
                 "--num-prompts", "7", "--slo", "a:ttft<10,max_gap<5", "--chunked-tokens", "64",
                 "--tune", "collocated=default,256")
    plan = cli.build_plan(args)
    assert plan.configs == ("collocated", "nixl") and plan.rates == (1.0, 2.5) and plan.seeds == (3, 4)
    assert not plan.calibrated and plan.headline_rate == 2.5
    assert plan.workload.num_prompts == 7 and plan.workload.input_len == 256
    assert plan.slos == (SLO.parse("a:ttft<10,max_gap<5"),)
    assert plan.chunked_tokens == 64 and plan.budgets("collocated") == (Budget(), Budget(256))
    default = cli.build_plan(parse())
    assert default.model == "small" and default.calibrated and len(default.seeds) >= 3 and not default.rates
    assert cli.build_plan(parse("--tune", "write=")).budgets("write") == ()
    with pytest.raises(SystemExit):  # argparse refuses the value itself (exit 2)
        parse("--rates", "1,x")
    with pytest.raises(SystemExit):
        parse("--configs", "disagg")


def test_cli_workloads():
    heavy = cli.build_plan(parse("--workload", "decode-heavy")).workload
    assert (heavy.input_len, heavy.output_len, heavy.kind) == (128, 512, "random")
    shared = cli.build_plan(parse("--workload", "shared-prefix")).workload
    assert shared.kind == "shared-prefix" and shared.prefix_len == 384 and shared.prefix_caching
    quick_shared = cli.build_plan(parse("--quick", "--workload", "shared-prefix")).workload
    assert quick_shared.prefix_len == 192 and quick_shared.prefix_len % 16 == 0


def test_a_presets_optional_configuration_is_dropped_with_a_note_only_while_unregistered(monkeypatch):
    from pdserve.bench.launcher_deployer import LauncherDeployer

    plan = cli.build_plan(parse())
    assert "adaptive" in plan.configs and plan.budgets("adaptive")
    monkeypatch.setattr(LauncherDeployer, "unavailable", lambda self, c: "not registered" if c == "adaptive" else None)
    kept, notes = cli.drop_unregistered(plan, explicit=False)
    assert "adaptive" not in kept.configs and not kept.budgets("adaptive")
    assert notes == ["adaptive: left out, its launcher mode is not registered yet."]
    assert cli.drop_unregistered(plan, explicit=True) == (plan, [])  # asked for by --configs: the run refuses it
    monkeypatch.setattr(LauncherDeployer, "unavailable", lambda self, c: None)
    assert cli.drop_unregistered(plan, explicit=False) == (plan, [])
