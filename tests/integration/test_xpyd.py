"""xPyD through vllm-router with prefix caching on (the default), real vLLM, tiny model: the CI
part of scripts/xpyd_check.py, on one cell (2 prefill + 1 decode, WRITE mode; the script runs
2P+1D and 1P+2D in WRITE and READ mode with 40 prompts and 40 conversations each, results in
benchmarks/xpyd/).

In order, on one cluster: the connector correctness check (agree with collocated serving, every
instance took part), prompts sharing a 1,000-token prefix (agree, and D's counters show that
only the blocks D lacked were moved), three-turn conversations through /v1/chat/completions
(agree turn by turn; D reuses earlier turns' blocks). After each workload no instance holds a
block. That any prefill pairs with any decode in both modes is tests/unit/launch/
test_xpyd_router_pairing.py (real vllm-router, fake workers).
"""

from __future__ import annotations

import pytest

from tests.integration.pd_helpers import prompts
from tests.integration.xpyd_helpers import (
    check_correctness,
    check_multi_turn,
    check_shared_prefix,
    conversations,
    references,
    shared_prefix_prompts,
    xpyd_cluster,
)

pytestmark = pytest.mark.integration

MODE, NUM_PREFILL, NUM_DECODE, PORT = "write", 2, 1, 29000
PROMPTS = prompts()  # the PD serving test's 40 prompts: its collocated reference is reused when present
NUM_CHECKED = 16  # of them, here (all 40: the script)
SHARED = shared_prefix_prompts(16)
CONVERSATIONS = conversations(8)


@pytest.fixture(scope="module")
def refs(greedy_reference):
    return references(greedy_reference, {"pd40": PROMPTS, "shared16": SHARED, "chat8x3": CONVERSATIONS})


@pytest.fixture(scope="module")
def xpyd(refs):
    with xpyd_cluster(MODE, PORT, NUM_PREFILL, NUM_DECODE) as cluster:
        yield cluster


def test_xpyd_output_equals_collocated_and_every_instance_took_part(xpyd, refs):
    print(check_correctness(xpyd, refs["pd40"][:NUM_CHECKED], PROMPTS[:NUM_CHECKED]))


def test_shared_prefix_agrees_and_moves_only_the_blocks_decode_lacks(xpyd, refs):
    print(check_shared_prefix(xpyd, refs["shared16"], SHARED))


def test_multi_turn_chat_agrees_turn_by_turn(xpyd, refs):
    print(check_multi_turn(xpyd, refs["chat8x3"], CONVERSATIONS))
