"""P serving whole requests (serve_decode) through vllm-router, real vLLM (WRITE, adaptive): P
registers as a decode instance too, so the router sends it a share of the decode legs. Those
requests are prefilled and decoded on P, their prefill legs dropped; the rest go P -> D as usual.
Every answer equals collocated serving and nothing is held or leaked afterwards."""

from __future__ import annotations

import pytest

from pdserve.compare import compare_greedy
from tests.integration.pd_helpers import (collocated_reference, greedy, moved, pd_pair, prompts, snapshot,
                                          wait_idle)

pytestmark = pytest.mark.integration

PROMPTS = prompts()  # the connector correctness check's 40 prompts (the same reference as test_adaptive)
SERVING = {"placement": "adaptive", "serve_decode": True}


@pytest.fixture(scope="module")
def reference(greedy_reference):
    return collocated_reference(greedy_reference, "pd40", PROMPTS)


@pytest.fixture(scope="module")
def serving(reference):
    with pd_pair("write", 32200, **SERVING) as cluster:
        yield cluster


def test_p_serves_a_share_of_whole_requests_and_every_answer_equals_collocated(serving, reference):
    before = snapshot(serving)
    output = greedy(serving.endpoint, serving, PROMPTS)
    result = compare_greedy(reference, output)
    print("serve_decode", result.summary())
    assert result.ok, result.mismatches()

    after = snapshot(serving)
    delta = lambda side, name, **labels: moved(before, after, side, name, **labels)  # noqa: E731
    whole = delta("p", "pdserve:placements_total", placement="whole", reason="serve_decode")
    on_d = delta("d", "pdserve:placements_total")
    print(f"served whole on P: {whole:.0f}, decoded on D: {on_d:.0f}")
    # the router picks the decode instance at random among two: fewer than 5 of 40 either way is ~1e-7
    assert whole + on_d == len(PROMPTS) and whole >= 5 and on_d >= 5, (whole, on_d)
    remote = delta("d", "pdserve:placements_total", placement="remote")
    assert delta("p", "pdserve:kv_transfers_completed_total") == remote
    assert delta("d", "pdserve:kv_transfers_completed_total") == remote
    assert delta("p", "pdserve:kv_transfers_failed_total") == 0 and delta("d", "pdserve:kv_recomputed_total") == 0
    # every prompt token is computed once, plus at most one token per dropped leg: P never ran a
    # prompt twice for a request it served whole
    computed = delta("p", "vllm:prompt_tokens_by_source_total", source="local_compute") + \
        delta("d", "vllm:prompt_tokens_by_source_total", source="local_compute")
    total = sum(len(p) for p in PROMPTS)
    print(f"prompt tokens: {total}, computed by P and D together: {computed:.0f}")
    assert computed <= total + 2 * len(PROMPTS)


def test_nothing_is_held_after_serving_whole_requests(serving):
    wait_idle(serving.prefill_url, 60)
    wait_idle(serving.decode_url, 60)
