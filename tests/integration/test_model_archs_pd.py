"""Architectures beyond Llama through PD at TP 1: a sliding-window family (Gemma 2 style, alternating
128-token windows and global layers) in WRITE mode answers every prompt as collocated serving of the
same model does (under the comparison rule), with prompts shorter than a block, on block edges and
well past the window. (MLA is refused at startup: test_unsupported_models.py.)

vLLM turns its hybrid KV cache manager off for PDConnector, so the sliding-window layers keep (and
PD moves) full-length KV; moving only the window is the open part of hybrid support."""

from __future__ import annotations

import random

import pytest

from pdserve.compare import compare_greedy, fetch_greedy
from pdserve.launch import UpOptions
from tests.integration.conftest import launched, model_of

pytestmark = pytest.mark.integration

PORT = 27900
MAX_TOKENS = 16


def prompts() -> list[list[int]]:
    rng = random.Random(11)
    return [[rng.randrange(10, 4000) for _ in range(n)] for n in (1, 15, 16, 17, 127, 128, 129, 300, 700, 1300)]


def greedy(options: UpOptions, batch: list) -> list:
    with launched(options) as cluster:
        return fetch_greedy(cluster.endpoint, batch, max_tokens=MAX_TOKENS, concurrency=4, model=model_of(cluster))


@pytest.mark.parametrize("arch, mode", [("gemma2", "write")])
def test_pd_equals_collocated(arch, mode):
    batch, model = prompts(), f"{arch}-tiny"
    reference = greedy(UpOptions(mode="collocated", model=model, port=PORT, enforce_eager=True), batch)
    candidate = greedy(UpOptions(mode=mode, model=model, port=PORT + 20, enforce_eager=True), batch)
    result = compare_greedy(reference, candidate)
    assert result.ok, result.summary()
