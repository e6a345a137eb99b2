import argparse

import pytest

from pdserve.bench import cli, tune
from pdserve.bench.slo import SLO
from pdserve.errors import ConfigError

from tests.unit.bench import synthetic


def trial(budget, gap, ttft_att):
    return tune.ChunkTrial(budget, max_gap_p90_ms=gap, ttft_p90_ms=100.0, ttft_attainment=ttft_att)


def test_choose_least_gap_among_budgets_keeping_ttft():
    plan = synthetic.plan()
    trials = [trial(64, 20.0, 0.5), trial(128, 40.0, 0.95), trial(256, 60.0, 1.0)]
    assert tune.choose(plan, trials).max_num_batched_tokens == 128
    # none keeps TTFT: best TTFT attainment wins
    assert tune.choose(plan, [trial(64, 20.0, 0.5), trial(128, 40.0, 0.7)]).max_num_batched_tokens == 128
    text = tune.to_json(trials, trials[1])
    assert tune.chosen_from_json(text) == 128


def test_trial_measures_gap_and_ttft(tmp_path):
    from pdserve.bench.records import load_bench_run

    path = tmp_path / "t.json"
    synthetic.write(path, synthetic.point_data(met_n=5, ttft_n=5))
    t = tune.trial(synthetic.plan(), 128, load_bench_run(path))
    assert t.ttft_attainment == 0.5 and t.max_gap_p90_ms == pytest.approx(20.0)


def parse(*argv):
    parser = argparse.ArgumentParser()
    cli.add_parser(parser.add_subparsers())
    return parser.parse_args(["bench", *argv])


def test_cli_overrides_the_preset():
    args = parse("--quick", "--configs", "collocated,nixl", "--rates", "1,2.5", "--seeds", "3,4",
                 "--num-prompts", "7", "--slo", "a:ttft<10,max_gap<5", "--chunked-tokens", "64")
    plan = cli.build_plan(args)
    assert plan.configs == ("collocated", "nixl") and plan.rates == (1.0, 2.5) and plan.seeds == (3, 4)
    assert plan.workload.num_prompts == 7 and plan.workload.input_len == 256
    assert plan.slos == (SLO.parse("a:ttft<10,max_gap<5"),)
    assert plan.chunked_tokens == 64 and plan.chunk_candidates == ()
    assert cli.build_plan(parse()).model == "small"
    with pytest.raises(ConfigError):
        cli.build_plan(parse("--rates", "1,x"))
    with pytest.raises(ConfigError):
        cli.build_plan(parse("--configs", "disagg"))
