"""`pdserve up --mode collocated`: serving, the greedy reference for other modes, the noise floor."""

import pytest

from pdserve.compare import compare_greedy, fetch_greedy
from pdserve.launch import UpOptions
from tests.integration.conftest import PROMPTS, check_serving, launched, requests_served

pytestmark = pytest.mark.integration
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def cluster():
    with launched(UpOptions(mode="collocated", port=18200, enforce_eager=True, prefix_caching=False)) as c:
        yield c


def test_serves_completions_and_chat_streaming_and_not(cluster):
    check_serving(cluster)
    assert requests_served(cluster.instance_urls["vllm"]) >= 4


def test_greedy_reference_and_noise_floor(cluster, greedy_reference):
    """Same instance, prompts one at a time vs 8 at a time: the batching noise floor."""
    one_at_a_time = fetch_greedy(cluster.endpoint, PROMPTS, MAX_TOKENS, concurrency=1)
    batched = fetch_greedy(cluster.endpoint, PROMPTS, MAX_TOKENS, concurrency=8)
    result = compare_greedy(one_at_a_time, batched)
    print(f"\nnoise floor (collocated, 1 vs 8 concurrent): {result.summary()}")
    assert result.ok, result.summary()
    greedy_reference["collocated"] = one_at_a_time
