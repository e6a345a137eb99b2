"""`pdserve up --mode round-robin`: two pinned instances behind vllm-router, same output as collocated."""

import pytest

from pdserve.compare import compare_greedy, fetch_greedy
from pdserve.launch import UpOptions
from tests.integration.conftest import PROMPTS, check_serving, launched, requests_served
from tests.integration.pd_helpers import reference_server
from tests.integration.test_up_collocated import MAX_TOKENS

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def cluster():
    with launched(UpOptions(mode="round-robin", port=18300, enforce_eager=True, prefix_caching=False)) as c:
        yield c


@pytest.fixture(scope="module")
def reference(greedy_reference):
    """The session's collocated reference's greedy output (from test_up_collocated, or computed now)."""
    if "collocated" not in greedy_reference:
        greedy_reference["collocated"] = fetch_greedy(reference_server(greedy_reference).endpoint, PROMPTS, MAX_TOKENS)
    return greedy_reference["collocated"]


def test_instances_are_pinned_one_core_each(cluster):
    import os

    for process, core in zip(cluster.instances, (0, 1)):
        assert os.sched_getaffinity(process.pid) == {core}


def test_serves_completions_and_chat_through_the_router_to_both_instances(cluster):
    check_serving(cluster)
    served = [requests_served(url) for url in cluster.instance_urls.values()]
    assert sum(served) >= 4 and all(n >= 1 for n in served), served


def test_greedy_output_equals_collocated(reference, cluster):
    result = compare_greedy(reference, fetch_greedy(cluster.endpoint, PROMPTS, MAX_TOKENS, concurrency=2))
    print(f"\nround-robin vs collocated: {result.summary()}")
    assert result.ok, result.summary()
