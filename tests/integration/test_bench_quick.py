"""End to end: `pdserve bench` on the tiny model, collocated and round-robin, two rates.

Starts real vLLM (through the launcher) and real `vllm bench serve`; about 3 minutes on 2 cores.
"""

from __future__ import annotations

import json

import pytest

from pdserve.cli import main
from pdserve.launch.ports import port_free

PORT = 18700  # not the CLI default 18800 (nor the unit tests' 18900s), so a manual `pdserve bench` and this test do not collide


@pytest.mark.integration
@pytest.mark.timeout(600)
def test_quick_bench_writes_raw_data_report_and_plots(tmp_path, tiny_model_dir):
    out = tmp_path / "quick"
    argv = ["bench", "--quick", "--seeds", "1", "--num-prompts", "12", "--out", str(out), "--port", str(PORT)]
    rc = main(argv)
    assert rc == 0

    for config in ("collocated", "round-robin"):
        for rate in ("4", "8"):
            raw = json.loads((out / "raw" / config / f"r{rate}_s1.json").read_text())
            assert len(raw["ttfts"]) == 12 and len(raw["itls"]) == 12
            assert raw["failed"] == 0 and all(n == 32 for n in raw["output_lens"])
            assert all(len(gaps) >= 1 for gaps in raw["itls"])

    report = (out / "report.md").read_text()
    assert "Incomplete" not in report
    assert "Requests meeting the SLO at 8 req/s" in report
    for config in ("collocated", "round-robin"):
        assert f"| {config} | " in report
        assert f"| {config} | not measured" not in report
    assert "÷ round-robin" in report and "÷ collocated" in report
    for png in ("attainment_blog.png", "attainment_tight.png", "attainment_stall.png", "distributions_r8.png"):
        assert (out / "plots" / png).read_bytes()[:4] == b"\x89PNG"

    # nothing left running: the launcher's ports are free again
    assert all(port_free(p) for p in range(PORT, PORT + 4))
    # a second identical invocation resumes: every point is done, so it starts nothing and rewrites the report
    assert main(argv) == 0
