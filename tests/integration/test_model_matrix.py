"""A part of the model × layout × mode matrix (scripts/model_matrix.py runs it whole, every cell in
both modes; results in benchmarks/model-matrix/): one cell of each model family, each mode in at
least one of them:

- a sliding-window model (Gemma 2 style: alternating 128-token windows and global layers, two KV
  cache groups) between instances of different tensor-parallel sizes, P TP 2 -> D TP 1, write mode
  (read mode and P TP 1 -> D TP 2 run in the whole matrix: there D's two ranks share a core, whose
  rounding parts from collocated serving at TP 2 at near-ties a 16-prompt sample may hold: a top-2
  gap of 0.188 at one prompt on an AMD EPYC): every answer through vllm-router equals collocated serving at D's
  tensor-parallel size under the comparison rule, every transfer completed (none failed, none
  recomputed), and D received at most the window's blocks of each sliding-window layer (and less
  than a transfer of every block would move);
- a hybrid model (Qwen3-Next style: Gated DeltaNet layers and a full-attention layer, four KV cache
  groups), 1P1D, read mode (write mode in the whole matrix): every answer equals collocated serving up to batching's rounding
  (max logprob difference at most 0.005; collocated serving against itself parts by 0.0005 across
  batchings, NixlConnector's last-token rule by 0.22), and D received exactly the attention blocks of each prompt's whole 64-token
  chunks that leave D two tokens or more, plus each Gated DeltaNet layer's state once, without
  its page's padding (kv_groups.py);
- an MLA model (DeepSeek-V2 style: one 576-wide latent per token, which every rank holds whole),
  P TP 2 -> D TP 1 in read mode: every answer equals collocated serving under the comparison rule,
  and D read each prompt's latents once, from one P rank (one sub-transfer, exactly a full
  transfer's bytes), the other P rank released without a read. It runs on CPU only with pdserve's
  patch of vLLM's rotary kernel (pdserve/vllm_patches/cpu_rope.py).

On this 2-core machine three ranks share two cores; prefill and decode keep a core each
(launch/cores.py), so the ranks of one instance share a core.
"""

from __future__ import annotations

import math

import pytest

from pdserve.model.build import resolve_model
from tests.integration.matrix_helpers import ARCHS, KvShape, matrix_prompts, references, run_cell

pytestmark = pytest.mark.integration

PORT = 28100
PROMPTS = matrix_prompts(count=16)


@pytest.fixture(scope="module")
def refs():
    """Collocated serving's answers of each architecture below at TP 1, their instances started at once."""
    answers = references(["sliding-window", "hybrid", "mla"], PROMPTS, PORT)

    def at(arch: str) -> list:
        return answers[arch]
    return at


@pytest.mark.parametrize("layout, mode, port", [("p-tp2-d-tp1", "write", PORT + 20)])
def test_sliding_window_model_between_tp_sizes_equals_collocated(refs, layout, mode, port):
    cell = run_cell("sliding-window", layout, mode, port, PROMPTS, refs("sliding-window"))
    assert cell["ok"], str(cell)
    assert cell["transfers"] == 2 * len(PROMPTS) and cell["transfers_failed"] == cell["recomputed"] == 0, str(cell)
    assert 0 < cell["bytes_moved"] <= cell["bytes_window_bound"] < cell["bytes_full"], str(cell)


GDN_CHUNK = 64
BATCH_NOISE = 0.005  # max |logprob diff| between batchings of the same serving


@pytest.mark.parametrize("mode, port", [("read", PORT + 80)])
def test_hybrid_model_equals_collocated_to_the_last_bit_moving_state_once(refs, mode, port):
    cell = run_cell("hybrid", "1p1d", mode, port, PROMPTS, refs("hybrid"))
    # collocated serving against itself in other batches parts by up to 0.0005 (measured), P computing
    # all but the last prompt token by up to 0.22
    assert cell["ok"] and float(cell["summary"].rsplit(" ", 1)[1]) <= BATCH_NOISE, str(cell)
    taken = [(len(p) - 2) // GDN_CHUNK * GDN_CHUNK for p in PROMPTS]
    shape = KvShape.of(resolve_model(ARCHS["hybrid"]), cell["float32_state"])
    expected = sum(math.ceil(t / shape.block_tokens) * shape.block_bytes * len(shape.windowed) + shape.state_bytes
                   for t in taken if t > 0)
    assert cell["transfers"] == sum(t > 0 for t in taken) and cell["transfers_failed"] == cell["recomputed"] == 0, \
        str(cell)
    assert cell["bytes_moved"] == expected, str(cell)


@pytest.mark.parametrize("mode, port", [("read", PORT + 100)])
def test_mla_model_read_from_one_of_two_p_ranks_equals_collocated(refs, mode, port):
    cell = run_cell("mla", "p-tp2-d-tp1", mode, port, PROMPTS, refs("mla"))
    assert cell["ok"], str(cell)
    assert cell["transfers"] == len(PROMPTS) and cell["transfers_failed"] == cell["recomputed"] == 0, str(cell)
    assert cell["bytes_moved"] == cell["bytes_full"], str(cell)
