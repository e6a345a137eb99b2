"""A representative part of the fault matrix (pdserve.faults.matrix) on real vLLM, both modes:
the restarts that once returned 200 with wrong tokens (READ: P restarted at the same address;
WRITE: D restarted), a copy that fails, and a copy queue slower than release_grace. The whole
matrix (lost, late, duplicated and reordered control messages, kills, preemption) runs as
scripts/fault_matrix.py, its results in benchmarks/fault-matrix/."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest

from pdserve.compare import fetch_greedy
from pdserve.faults.matrix import MAX_TOKENS, TIMEOUTS, Matrix, cells
from pdserve.launch import Cluster, UpOptions
from pdserve.launch.modes import with_front
from pdserve.launch.pd_modes import pd_deployment
from pdserve.model.build import resolve_model
from tests.integration.pd_helpers import LOG_DIR, model_name, prompts, reference_server

pytestmark = pytest.mark.integration

PORTS = {"write": 26100, "read": 26200}
CELLS = {
    "write": ["decode restarted", "copy queue slower than release_grace"],
    "read": ["prefill restarted", "copy fails mid-layer"],
}
PROMPTS = prompts(8, seed=21)


def _options(mode: str) -> UpOptions:
    return UpOptions(mode=mode, model=str(resolve_model("tiny")), port=PORTS[mode], enforce_eager=True,
                     extra_vllm_args=("--max-num-batched-tokens", "512"))


@pytest.fixture(scope="module")
def reference(greedy_reference):
    if "faults-matrix8" not in greedy_reference:
        cluster = reference_server(greedy_reference)  # the session's collocated instance, as _options would launch
        greedy_reference["faults-matrix8"] = fetch_greedy(cluster.endpoint, PROMPTS, max_tokens=MAX_TOKENS,
                                                          concurrency=4, model=model_name(cluster))
    return greedy_reference["faults-matrix8"]


@pytest.fixture(scope="module", params=["write", "read"])
def matrix(request, reference):
    mode = request.param
    with tempfile.TemporaryDirectory(prefix="pdserve-faults-") as tmp:
        plan_path = Path(tmp) / "plan.json"
        plan_path.write_text(json.dumps({"rules": []}))
        deployment = with_front(pd_deployment(_options(mode), mode,
                                              connector_extra={**TIMEOUTS, "test_fault_plan": str(plan_path)}), 5.0)
        with Cluster(deployment, restart="on-failure", log_dir=LOG_DIR / f"faults-{mode}") as cluster:
            cluster.wait_healthy(600)
            m = Matrix(cluster, mode, plan_path, PROMPTS, reference, model_name(cluster))
            m._wait_back("decode")
            m.warm_up()
            yield m


@pytest.mark.parametrize("index", range(2))
def test_fault_cell(matrix, index):
    name = CELLS[matrix.mode][index]
    cell = next(c for c in cells(matrix.mode) if c.name == name)
    result = matrix.run(cell)
    print(json.dumps(result.__dict__))
    assert result.wrong == 0, f"{name}: {result.wrong} responses were 200 with wrong tokens"
    assert result.late == 0, f"{name}: {result.late} requests ended after their deadline + 5 s"
    assert not result.errors, f"{name}: {result.errors}"
    assert result.idle_seconds is not None, f"{name}: the survivors' KV never returned to idle"
    assert result.next_ok, f"{name}: the next requests were not served correctly"
    assert result.passed
    if cell.rules and name != "copy queue slower than release_grace":
        assert result.recomputed > 0, f"{name}: the fault never hit a transfer (nothing was recomputed)"
