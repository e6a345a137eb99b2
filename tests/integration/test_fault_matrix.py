"""A representative cell of the fault matrix (pdserve.faults.matrix) on real vLLM in each mode: the
restarts that once returned 200 with wrong tokens (READ: P restarted at the same address; WRITE: D
restarted). The whole matrix (failed and slow copies, lost, late, duplicated and reordered control
messages, kills, preemption; 36 cells) runs as scripts/fault_matrix.py, its results in
benchmarks/fault-matrix/; a corrupted copy caught by the KV digest runs in test_pd_faults. Here the cells run on the shared
write and read deployments (pool.py), through their fault plans and with their deadlines."""

from __future__ import annotations

import json

import pytest

from pdserve.compare import fetch_greedy
from pdserve.faults.matrix import MAX_TOKENS, Matrix, cells
from tests.integration.pd_helpers import TIMEOUTS, model_name, prompts, reference_server
from tests.integration.pool import shared

pytestmark = pytest.mark.integration

CELLS = {"write": "decode restarted", "read": "prefill restarted"}
PROMPTS = prompts(8, seed=21)


@pytest.fixture(scope="module")
def reference(greedy_reference):
    if "faults-matrix8" not in greedy_reference:
        cluster = reference_server(greedy_reference)  # the session's collocated instance
        greedy_reference["faults-matrix8"] = fetch_greedy(cluster.endpoint, PROMPTS, max_tokens=MAX_TOKENS,
                                                          concurrency=4, model=model_name(cluster))
    return greedy_reference["faults-matrix8"]


pd = shared("pd-write", "pd-read")


@pytest.fixture(scope="module")
def matrix(pd, reference):
    m = Matrix(pd, pd.mode, pd.fault_plan, PROMPTS, reference, model_name(pd), timeouts=TIMEOUTS)
    m._wait_back("decode")
    m.warm_up()
    return m


def test_fault_cell(matrix):
    name = CELLS[matrix.mode]
    cell = next(c for c in cells(matrix.mode, timeouts=TIMEOUTS) if c.name == name)
    result = matrix.run(cell)
    print(json.dumps(result.__dict__))
    assert result.wrong == 0, f"{name}: {result.wrong} responses were 200 with wrong tokens"
    assert result.late == 0, f"{name}: {result.late} requests ended after their deadline + 5 s"
    assert not result.errors, f"{name}: {result.errors}"
    assert result.idle_seconds is not None, f"{name}: the survivors' KV never returned to idle"
    assert result.next_ok, f"{name}: the next requests were not served correctly"
    assert result.passed
    if cell.rules:
        assert result.recomputed > 0, f"{name}: the fault never hit a transfer (nothing was recomputed)"
