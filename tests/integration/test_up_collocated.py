"""`pdserve up --mode collocated` (the session's collocated reference, which every PD test compares
against): serving, the greedy reference for other modes, the noise floor."""

import pytest

from pdserve.compare import compare_greedy, fetch_greedy
from tests.integration.conftest import PROMPTS, check_serving, requests_served
from tests.integration.pd_helpers import reference_server

pytestmark = pytest.mark.integration
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def cluster(greedy_reference):
    return reference_server(greedy_reference)


def test_serves_completions_and_chat_streaming_and_not(cluster):
    before = requests_served(cluster.instance_urls["vllm"])
    check_serving(cluster)
    assert requests_served(cluster.instance_urls["vllm"]) >= before + 4


def test_greedy_reference_and_noise_floor(cluster, greedy_reference):
    """Same instance, prompts one at a time vs 8 at a time: the batching noise floor."""
    one_at_a_time = fetch_greedy(cluster.endpoint, PROMPTS, MAX_TOKENS, concurrency=1)
    batched = fetch_greedy(cluster.endpoint, PROMPTS, MAX_TOKENS, concurrency=8)
    result = compare_greedy(one_at_a_time, batched)
    print(f"\nnoise floor (collocated, 1 vs 8 concurrent): {result.summary()}")
    assert result.ok, result.summary()
    greedy_reference["collocated"] = one_at_a_time
