"""scripts/gpu_check.py with --device cpu: the device check's logic, with CPU tensors standing in
for GPU memory (no vLLM; a few seconds). The check itself on a GPU: benchmarks/gpu/README.md."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu_check.py"
CHECKS = {"write_contiguous", "read_contiguous", "bursts_contiguous", "write_scattered", "read_scattered",
          "bursts_scattered", "kill_decode_during_write", "kill_prefill_during_read"}


def test_gpu_check_passes_on_cpu_stand_ins_and_writes_its_results(tmp_path):
    done = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path / "out"), "--device", "cpu", "--repeats", "2"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    results = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    summary = (tmp_path / "out" / "summary.txt").read_text().strip()
    assert done.stdout.strip().splitlines()[-1] == summary == results["summary"]
    assert summary.startswith("gpu_check PASS device=cpu") and results["tokens"] == 2000
    assert set(results["checks"]) == CHECKS and all(check["ok"] for check in results["checks"].values())
    for name in ("write_scattered", "read_scattered"):
        assert results["checks"][name]["verify"]["blocks_checked"] == 125 * results["config"]["layers"]
    for name in ("kill_decode_during_write", "kill_prefill_during_read"):
        kill = results["checks"][name]
        assert kill["result"]["status"] == "FAILED" and "exited" in kill["result"]["errors"][0]
        assert 0 <= kill["fail_after_kill_s"] < kill["deadline_after_kill_s"]
    assert results["bandwidth"]["plain_copy_GBps"] > 0
