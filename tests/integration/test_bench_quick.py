"""End to end: `pdserve bench --quick` on the tiny model: calibration, collocated (on the
calibration deployment) and adaptive, into a new run directory under the work directory, leaving
every committed file as it was.

Starts real vLLM (through the launcher) and real `vllm bench serve`; a few minutes on 2 cores.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from pdserve.bench.placements import CHUNK_PREFIX
from pdserve.bench.plan import BenchPlan
from pdserve.cli import main
from pdserve.paths import work_dir
from tests.integration.port_check import still_bound

PORT = 31100  # not the CLI default, so a manual `pdserve bench` and this test do not collide
ROOT = Path(__file__).resolve().parents[2]


def committed_state() -> str:
    """What git sees changed in the tracked files the bench could touch (docs and committed runs)."""
    return subprocess.run(["git", "status", "--porcelain", "--", "benchmarks", "docs", "README.md"],
                          cwd=ROOT, capture_output=True, text=True, check=True).stdout


def new_run(before: set[Path]) -> Path:
    runs = set((work_dir() / "runs").glob("bench-quick-*")) - before
    assert len(runs) == 1, runs
    return runs.pop()


@pytest.mark.integration
@pytest.mark.timeout(900)
def test_quick_bench_calibrates_replays_one_stream_and_reports(tiny_model_dir):
    # the quick preset's configurations less write (its deployment is the same as adaptive's, minus placement),
    # one seed, 12 prompts: the machinery end to end in CI time
    argv = ["bench", "--quick", "--configs", "collocated,adaptive", "--seeds", "1", "--num-prompts", "12",
            "--port", str(PORT)]
    committed, before = committed_state(), set((work_dir() / "runs").glob("bench-quick-*"))
    rc = main(argv)
    out = new_run(before)
    try:
        check_run(out, rc)
        assert committed_state() == committed  # the README's command touches no committed file
    finally:
        shutil.rmtree(out)


def check_run(out: Path, rc: int) -> None:
    assert rc == 0

    calibration = json.loads((out / "calibration.json").read_text())
    assert calibration["prefill_ms"] > 0 and calibration["capacity"] > 0 and calibration["machine"]["num_cpus"] >= 1
    plan = BenchPlan.load(out / "plan.json")
    rates = sorted(round(f * calibration["capacity"], 2) for f in plan.rate_fractions)
    configs = ["collocated", "adaptive"]
    assert list(plan.configs) == configs

    for config in configs:
        for rate in rates:
            raw = json.loads((out / "raw" / config / f"r{rate:g}_s1.json").read_text())
            assert len(raw["ttfts"]) == 12 and len(raw["itls"]) == 12
            assert raw["failed"] == 0 and all(n == 32 for n in raw["output_lens"])
            assert all(n == 256 for n in raw["input_lens"])
            assert all(len(gaps) >= 1 for gaps in raw["itls"])
    # common random numbers: at both rates the same prompts arrive in the same pattern, scaled
    low, high = ([json.loads(line) for line in (out / "traces" / f"r{r:g}_s1.jsonl").read_text().splitlines()]
                 for r in rates)
    assert [row["hash_ids"] for row in low] == [row["hash_ids"] for row in high]
    assert [row["timestamp"] * rates[0] for row in low] == pytest.approx([row["timestamp"] * rates[1] for row in high],
                                                                        abs=1e-4)

    # decode's placement decisions over each point, from its /metrics: every adaptive request placed once,
    # none for plain serving; beside them decode's steps with a local chunk, by whether they kept their bound
    for rate in rates:
        counts = json.loads((out / "placements" / "adaptive" / f"r{rate:g}_s1.json").read_text())
        decided = {k: n for k, n in counts.items() if not k.startswith(CHUNK_PREFIX)}
        assert sum(decided.values()) == 12 and all(k.split(":")[0] in ("remote", "local") for k in decided)
        assert {k for k in counts if k.startswith(CHUNK_PREFIX)} <= {CHUNK_PREFIX + "within", CHUNK_PREFIX + "over"}
        assert json.loads((out / "placements" / "collocated" / f"r{rate:g}_s1.json").read_text()) == {}

    report = (out / "report.md").read_text()
    assert "## Placement decisions" in report and "| adaptive | " in report.split("## Placement decisions")[1]
    assert "Incomplete" not in report
    assert f"Requests meeting the SLO at {rates[1]:g} req/s" in report
    assert "Machine: " in report and "Scored: the steady window" in report
    assert "0 of " in report and "finished short" in report
    for config in configs:
        assert f"| {config} | " in report and f"| {config} | not measured" not in report
    assert "÷ collocated" in report
    for png in ("attainment_blog.png", "attainment_gap50.png", f"distributions_r{rates[1]:g}.png"):
        assert (out / "plots" / png).read_bytes()[:4] == b"\x89PNG"

    # nothing left running: the launcher's ports are free again
    bound = still_bound(range(PORT, PORT + 6))
    assert not bound, bound
    # --out alone resumes: every point is done, so it starts nothing and rewrites the report
    assert main(["bench", "--out", str(out), "--port", str(PORT)]) == 0
    # SLOs evaluated afterwards on the same requests are marked as such
    assert main(["bench", "--report-only", "--out", str(out), "--slo", "late:ttft<2000,max_gap<200"]) == 0
    assert "## SLO `late:ttft<2000,max_gap<200` (added after the run, with --report-only)" in (out / "report.md").read_text()
