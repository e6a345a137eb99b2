"""Seeded sampling with a prompt longer than a prefill chunk, for every mode's deployment.

vLLM samples for a request also on a step that prefills only part of its prompt, discards that
token and rewinds the request's seeded generator; on CPU that rewind used to kill the engine
(pdserve.vllm_patches). These helpers send such a request (n=3, temperature 1.0, 2,100 tokens: five
512-token chunks) and check it is served, reproducibly, by an instance that keeps serving.
"""

from __future__ import annotations

import random

import requests

from tests.integration.pd_helpers import CHUNK_TOKENS, model_name

SEEDED_PROMPT = [random.Random(36).randrange(10, 4000) for _ in range(2100)]
NUM_CHOICES = 3
SEEDED = {"prompt": SEEDED_PROMPT, "n": NUM_CHOICES, "temperature": 1.0, "seed": 2024, "max_tokens": 16,
          "ignore_eos": True}
assert len(SEEDED_PROMPT) > 4 * CHUNK_TOKENS


def seeded_texts(cluster) -> list[str]:
    """The three texts of the seeded request, served through the cluster's endpoint with a 200."""
    response = requests.post(f"{cluster.endpoint}/v1/completions", timeout=300,
                             json={"model": model_name(cluster), **SEEDED})
    assert response.status_code == 200, response.text
    choices = sorted(response.json()["choices"], key=lambda choice: choice["index"])
    assert len(choices) == NUM_CHOICES and all(choice["text"] for choice in choices), choices
    return [choice["text"] for choice in choices]


def check_seeded_requests(cluster) -> list[str]:
    """The seeded request twice: 200s, the same three texts both times, three different texts (each
    choice has its own seed, so sampling really ran), and every instance still serving afterwards."""
    first = seeded_texts(cluster)
    assert seeded_texts(cluster) == first
    assert len(set(first)) == NUM_CHOICES, first
    check_still_serving(cluster)
    return first


def check_still_serving(cluster) -> None:
    for url in cluster.instance_urls.values():
        assert requests.get(f"{url}/health", timeout=30).status_code == 200, url
    response = requests.post(f"{cluster.endpoint}/v1/completions", timeout=120, json={
        "model": model_name(cluster), "prompt": SEEDED_PROMPT[:600], "max_tokens": 4, "temperature": 0})
    assert response.status_code == 200, response.text
