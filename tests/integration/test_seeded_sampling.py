"""Collocated serving of a seeded request whose prompt spans several prefill chunks: served, the
instance keeps serving, and the texts equal those of the same request prefilled in a single step.

The session's collocated instance (512-token chunks, prefix caching on) serves the request twice.
The first time each choice's prompt is prefilled in 512-token chunks, and vLLM samples and discards
on every chunk but the last; the second time all but its last partial block comes from the prefix
cache and each choice is prefilled in one step, with no discarded sample. Equal texts mean the
discarded samples left the seeded generators exactly as they were. The PD modes run the same request
in test_pd_serving.py (write, read) and test_adaptive.py (adaptive write and read).
"""

from __future__ import annotations

import pytest

from tests.integration.pd_helpers import CHUNK_TOKENS, metric, metrics, reference_server
from tests.integration.seeded_requests import NUM_CHOICES, SEEDED_PROMPT, check_still_serving, seeded_texts

pytestmark = pytest.mark.integration


def test_seeded_chunked_prefill_samples_as_a_single_step_prefill(greedy_reference):
    cluster = reference_server(greedy_reference)
    url = next(iter(cluster.instance_urls.values()))

    chunked = seeded_texts(cluster)
    hits = metric(metrics(url), "vllm:prefix_cache_hits_total")
    whole = seeded_texts(cluster)
    cached = metric(metrics(url), "vllm:prefix_cache_hits_total") - hits

    assert NUM_CHOICES * len(SEEDED_PROMPT) - cached < CHUNK_TOKENS, "the repeat was prefilled in chunks"
    assert whole == chunked
    assert len(set(chunked)) == NUM_CHOICES, chunked
    check_still_serving(cluster)
