"""What PDConnector cannot serve yet is refused at startup with its reason (connector/support.py): an
MLA model under adaptive placement through `pdserve up` ends in one line that names the model and
the missing support, and nothing is left running. (The other refusals take the same path: tests/unit/connector/test_support.py.)"""

import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration

PORT = 18440


@pytest.mark.parametrize("model, mode, why", [
    ("deepseek-v2-tiny", "adaptive", "multi-head latent attention (MLA); adaptive placement has not been tried"),
])
def test_model_is_refused_at_startup_naming_why(model, mode, why):
    result = subprocess.run([sys.executable, "-m", "pdserve.cli", "up", "--mode", mode, "--model", model,
                             "--port", str(PORT), "--enforce-eager", "--restart", "never"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 1, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "PDConnector cannot serve this configuration" in lines[0], lines[0]
    assert why in lines[0], lines[0]
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    assert not [line for line in ps.splitlines() if f"--port {PORT + 1}" in line or f"--port {PORT + 2}" in line]
