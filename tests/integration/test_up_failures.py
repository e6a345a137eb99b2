"""An instance that dies during start: one-line error, non-zero exit, nothing left running."""

import subprocess
import sys

import pytest

from pdserve.launch.env import runs_dir

pytestmark = pytest.mark.integration


def test_instance_dying_during_start():
    before = set(runs_dir().glob("18400-*")) if runs_dir().exists() else set()
    result = subprocess.run([sys.executable, "-m", "pdserve.cli", "up", "--port", "18400", "--enforce-eager",
                             "--vllm-args", "--no-such-flag 1"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("pdserve: error: vllm exited with code") and "--no-such-flag" in lines[0]
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    assert not [line for line in ps.splitlines() if "--port 18400" in line]
    assert set(runs_dir().glob("18400-*")) == before
