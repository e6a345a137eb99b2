"""A part of the model × layout × mode matrix (scripts/model_matrix.py runs it whole; results in
benchmarks/model-matrix/): a sliding-window model (Gemma 2 style: alternating 128-token windows and
global layers, two KV cache groups) between instances of different tensor-parallel sizes, one cell
in each mode: P TP 2 -> D TP 1 in WRITE and P TP 1 -> D TP 2 in READ. Every answer through
vllm-router equals collocated serving at D's tensor-parallel size under the comparison rule, every transfer completed (none
failed, none recomputed), and D received at most the window's blocks of each sliding-window layer
(and less than a transfer of every block would move).

On this 2-core machine three ranks share two cores; prefill and decode keep a core each
(launch/cores.py), so the ranks of one instance share a core.
"""

from __future__ import annotations

import pytest

from tests.integration.matrix_helpers import decode_tp, matrix_prompts, reference, run_cell

pytestmark = pytest.mark.integration

PORT = 28100
PROMPTS = matrix_prompts(count=16)


@pytest.fixture(scope="module")
def refs():
    """Collocated serving's answers by tensor-parallel size, each fetched once."""
    answers = {}

    def at(tp: int) -> list:
        if tp not in answers:
            answers[tp] = reference("sliding-window", PROMPTS, PORT, tp)
        return answers[tp]
    return at


@pytest.mark.parametrize("layout, mode, port", [("p-tp2-d-tp1", "write", PORT + 20), ("p-tp1-d-tp2", "read", PORT + 40)])
def test_sliding_window_model_between_tp_sizes_equals_collocated(refs, layout, mode, port):
    cell = run_cell("sliding-window", layout, mode, port, PROMPTS, refs(decode_tp(layout)))
    assert cell["ok"], str(cell)
    assert cell["transfers"] == 2 * len(PROMPTS) and cell["transfers_failed"] == cell["recomputed"] == 0, str(cell)
    assert 0 < cell["bytes_moved"] <= cell["bytes_window_bound"] < cell["bytes_full"], str(cell)
