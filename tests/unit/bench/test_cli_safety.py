"""`pdserve bench` is safe to run: a new run directory by default, every bad value and every
conflict refused in one line with exit 2 before anything is written, and a run that failed before
measuring never blocks its corrected rerun."""

from __future__ import annotations

import json

import pytest

from pdserve.bench import cli
from pdserve.bench.results import ResultsDir
from pdserve.cli import main
from pdserve.errors import LaunchError
from tests.unit.bench import synthetic

# (argv, what the one error line must name)
BAD = [
    (["--num-prompts", "0"], "--num-prompts"),
    (["--num-prompts", "x"], "--num-prompts"),
    (["--input-len", "-5"], "--input-len"),
    (["--output-len", "0"], "--output-len"),
    (["--burstiness", "0"], "--burstiness"),
    (["--rates", "1,x"], "--rates"),
    (["--rates", "0"], "--rates"),
    (["--rates", "1,1"], "--rates"),
    (["--rates", ","], "--rates"),
    (["--rate-fractions", "-0.5"], "--rate-fractions"),
    (["--seeds", "1,a"], "--seeds"),
    (["--seeds", "2,2"], "--seeds"),
    (["--configs", "disagg"], "--configs"),
    (["--configs", "write,write"], "--configs"),
    (["--configs", "adaptive@nope"], "--configs"),
    (["--slo", "blog:ttft<"], "--slo"),
    (["--slo", "blog:latency<5"], "--slo"),
    (["--slo", "x:ttft<1,ttft<2"], "--slo"),
    (["--tune", "write"], "--tune"),
    (["--tune", "nope=512"], "--tune"),
    (["--tune", "write=8"], "--tune"),
    (["--tune", "collocated=512/256"], "--tune"),
    (["--tune", "write=512+serve"], "--tune"),
    (["--tune-slo", "nope"], "--tune-slo"),
    (["--target", "0"], "--target"),
    (["--target", "1.5"], "--target"),
    (["--headline-rate", "-1"], "--headline-rate"),
    (["--warmup-fraction", "0.95"], "--warmup-fraction"),
    (["--warmup-fraction", "0.5", "--cooldown-fraction", "0.4"], "--cooldown-fraction"),
    (["--chunked-tokens", "4"], "--chunked-tokens"),
    (["--chunk-candidates", "256,x"], "--chunk-candidates"),
    (["--port", "0"], "--port"),
    (["--port", "65530"], "--port"),
    (["--model", "/nonexistent"], "--model"),
    (["--workload", "nope"], "--workload"),
    (["--preset", "nope"], "--preset"),
    # conflicts
    (["--rates", "1", "--rate-fractions", "0.5"], "--rate-fractions"),
    (["--quick", "--preset", "default"], "--preset"),
    (["--chunked-tokens", "64", "--chunk-candidates", "64,128"], "--chunk-candidates"),
    (["--report-only"], "--report-only"),
    (["--report-only", "--rates", "1"], "--rates"),
]


def refused(argv, capsys) -> str:
    """Runs `pdserve bench ARGV`, asserts exit 2 (from the parser or the runner), and returns its one error line."""
    try:
        code = main(["bench", *argv])
    except SystemExit as stop:
        code = stop.code
    assert code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    errors = [line for line in err.splitlines() if "error:" in line]
    assert len(errors) == 1, err
    return errors[0]


@pytest.mark.parametrize(("argv", "flag"), BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_input_is_refused_in_one_line_naming_the_flag_and_nothing_is_written(argv, flag, tmp_path, capsys,
                                                                                  monkeypatch):
    monkeypatch.setattr(cli, "default_out", lambda args: pytest.fail("a refused command chose a run directory"))
    out = tmp_path / "run"
    line = refused([*argv, "--out", str(out)] if "--report-only" not in argv else argv, capsys)
    assert flag in line
    assert not out.exists()


def test_a_model_directory_without_a_tokenizer_is_refused(tmp_path, capsys):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    assert "tokenizer.json" in refused(["--model", str(tmp_path / "m")], capsys)


def test_out_that_is_a_file_is_refused(tmp_path, capsys):
    (tmp_path / "f").write_text("")
    assert "--out" in refused(["--quick", "--out", str(tmp_path / "f")], capsys)


def test_default_output_is_a_new_run_directory_under_the_work_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("PDSERVE_HOME", str(tmp_path))
    monkeypatch.setenv("PDSERVE_WORK_DIR", str(tmp_path))
    path = cli.default_out(cli_args("--quick", "--workload", "decode-heavy"))
    assert path.parent == tmp_path.resolve() / "runs" and not path.exists()
    assert path.name.startswith("bench-quick-decode-heavy-")
    assert cli.default_out(cli_args()).name.startswith("bench-default-2")


def cli_args(*argv):
    import argparse

    parser = argparse.ArgumentParser()
    cli.add_parser(parser.add_subparsers())
    return parser.parse_args(["bench", *argv])


class FailingModel(LaunchError):
    pass


def test_a_run_failing_before_its_plan_is_stored_leaves_nothing(monkeypatch, tmp_path):
    import pdserve.model.build

    def fail(name):
        raise FailingModel("cannot build")

    monkeypatch.setattr(pdserve.model.build, "resolve_model", fail)
    out = tmp_path / "run"
    with pytest.raises(FailingModel):
        cli.run(cli_args("--quick", "--configs", "collocated", "--out", str(out)))
    assert not out.exists()


def test_resume_refuses_a_measured_run_of_another_plan_naming_the_flags(monkeypatch, tmp_path, capsys):
    import pdserve.model.build

    monkeypatch.setattr(pdserve.model.build, "resolve_model", lambda name: tmp_path)
    out = tmp_path / "run"
    results = ResultsDir(out)
    results.open_plan(cli.build_plan(cli_args("--quick", "--seeds", "1")))
    results.calibration_path.write_text("{}")  # measured
    line = refused(["--quick", "--seeds", "1,2", "--num-prompts", "5", "--out", str(out)], capsys)
    assert "--seeds" in line and "--num-prompts" in line and str(out) in line
    assert json.loads(results.plan_path.read_text())["seeds"] == [1]


def test_out_alone_resumes_the_stored_plan(monkeypatch, tmp_path):
    import pdserve.bench.runner
    import pdserve.model.build

    monkeypatch.setattr(pdserve.model.build, "resolve_model", lambda name: tmp_path)
    out = tmp_path / "run"
    stored = cli.build_plan(cli_args("--quick", "--seeds", "4", "--workload", "decode-heavy"))
    results = ResultsDir(out)
    results.open_plan(stored)
    results.calibration_path.write_text("{}")
    results.notes_path.write_text('["the first run\'s note"]')
    started = []

    class Runner:
        def __init__(self, plan, results, deployer, model_dir, notes):
            started.append((plan, notes))

        def run(self):
            return results.report_path

    monkeypatch.setattr(pdserve.bench.runner, "Runner", Runner)
    assert cli.run(cli_args("--out", str(out), "--port", "31200")) == 0
    assert started == [(stored, ["the first run's note"])]


def test_an_unmeasured_run_takes_the_corrected_plan(monkeypatch, tmp_path):
    import pdserve.bench.runner
    import pdserve.model.build

    monkeypatch.setattr(pdserve.model.build, "resolve_model", lambda name: tmp_path)
    out = tmp_path / "run"
    ResultsDir(out).open_plan(synthetic.plan())  # a run that stopped before measuring anything

    class StopBeforeMeasuring(Exception):
        pass

    def runner(*args, **kwargs):
        raise StopBeforeMeasuring

    monkeypatch.setattr(pdserve.bench.runner, "Runner", runner)
    with pytest.raises(StopBeforeMeasuring):
        cli.run(cli_args("--quick", "--configs", "collocated", "--seeds", "7", "--out", str(out)))
    assert json.loads((out / "plan.json").read_text())["seeds"] == [7]


def test_building_the_parsers_imports_nothing_heavy():
    import subprocess
    import sys

    code = ("import sys, argparse\nfrom pdserve.bench import cli, pair_cli\n"
            "p = argparse.ArgumentParser(); s = p.add_subparsers()\ncli.add_parser(s); pair_cli.add_parser(s)\n"
            "print(sorted(m for m in ('torch', 'vllm', 'scipy', 'matplotlib', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_report_only_judges_the_stored_plan_under_other_slos(monkeypatch, tmp_path):
    import pdserve.bench.runner

    out = tmp_path / "run"
    ResultsDir(out).open_plan(synthetic.plan(configs=("collocated", "adaptive")))
    published = []
    monkeypatch.setattr(pdserve.bench.runner, "publish",
                        lambda plan, results, added_slos: published.append((plan, added_slos)) or results.report_path)
    # the preset's own configurations (adaptive@blog) play no part: only the stored plan is re-judged
    assert cli.run(cli_args("--report-only", "--out", str(out), "--slo", "late:ttft<2000,max_gap<200")) == 0
    (plan, added), = published
    assert [s.name for s in plan.slos] == ["late"] and added == ["late"] and plan.configs == ("collocated", "adaptive")
