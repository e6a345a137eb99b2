"""A part of the model × layout × mode matrix (scripts/model_matrix.py runs it whole; results in
benchmarks/model-matrix/): a sliding-window model (Gemma 2 style: alternating 128-token windows and
global layers, two KV cache groups) between instances of different tensor-parallel sizes: P TP 2 ->
D TP 1 in WRITE. (P TP 1 -> D TP 2 in READ through vllm-router failed every handshake on this
2-core machine in two CI runs, "connection refused" from P's handshake port, while the same layout
without the router agreed with plain serving: an open defect, not yet understood, so it is not
claimed here.) Every answer through vllm-router equals collocated
serving under the comparison rule, and D received at most the window's blocks of each
sliding-window layer (and less than a transfer of every block would move).

Three tensor-parallel ranks on two cores starve one another at times (seen here: handshakes
unanswered for 10 s, control messages delivered 34 to 85 s after they were sent, past the codec's
30 s replay window). A transfer that
fails then is recomputed by D, so the test holds every answer to the comparison rule and asks only
that KV moved (scripts/model_matrix.py records how many transfers failed)."""

from __future__ import annotations

import pytest

from tests.integration.matrix_helpers import matrix_prompts, reference, run_cell

pytestmark = pytest.mark.integration

PORT = 28100
PROMPTS = matrix_prompts(count=16)


@pytest.fixture(scope="module")
def refs():
    return reference("sliding-window", PROMPTS, PORT)


@pytest.mark.parametrize("layout, mode, port", [("p-tp2-d-tp1", "write", PORT + 20)])
def test_sliding_window_model_between_tp_sizes_equals_collocated(refs, layout, mode, port):
    cell = run_cell("sliding-window", layout, mode, port, PROMPTS, refs)
    assert cell["ok"], str(cell)
    assert cell["transfers"] > 0 and cell["recomputed"] <= cell["transfers_failed"], str(cell)
    assert 0 < cell["bytes_moved"] <= cell["bytes_window_bound"] < cell["bytes_full"], str(cell)
