"""Availability through the front (write mode, tiny model, instances restarted on failure): a
request survives the death of the instance serving it.

In order, on the shared write deployment (pool.py): D SIGKILLed mid-stream (the stream continues
on P, its tokens those of an uninterrupted collocated run, its usage whole; the supervisor restarts
D alone, on its core); P SIGKILLed (requests sent right after fall back to D, greedy outputs equal
collocated serving); both SIGKILLed (an OpenAI-shaped 503). After each death the restarted
instance is used through the router again."""

import json
import os
import time

import pytest
import requests

from pdserve.bench.samples import metric, parse_samples
from pdserve.compare import compare_greedy, fetch_greedy, parse_stream
from pdserve.launch import UpOptions
from pdserve.launch.process import group_members
from tests.integration.pd_helpers import (
    MAX_TOKENS,
    collocated_reference,
    greedy,
    model_name,
    prompts,
    reference_server,
)
from tests.integration.pool import kill, shared, wait_back

pytestmark = pytest.mark.integration

PROMPTS = prompts(8, seed=77)
LONG = 200  # tokens of the stream broken mid-way


@pytest.fixture(scope="module")
def reference(greedy_reference):
    """Collocated serving's greedy outputs: PROMPTS at MAX_TOKENS, and PROMPTS[3] at LONG tokens."""
    short = collocated_reference(greedy_reference, "availability8", PROMPTS)
    if "availability-long" not in greedy_reference:
        server = reference_server(greedy_reference)
        greedy_reference["availability-long"] = fetch_greedy(server.endpoint, [PROMPTS[3]], max_tokens=LONG)
    return short, greedy_reference["availability-long"]


cluster = shared("pd-write")


def front_metrics(cluster) -> dict[str, float]:
    return parse_samples(requests.get(f"{cluster.endpoint}/metrics", timeout=10).text)


def test_decode_killed_mid_stream_continues_on_prefill(cluster, reference):
    prompt, expected = PROMPTS[3], reference[1]
    body = {"model": model_name(cluster), "prompt": prompt, "max_tokens": LONG, "temperature": 0, "logprobs": 2,
            "return_token_ids": True, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    events, killed = [], None
    continued = metric(front_metrics(cluster), "pdserve:requests_continued_total")
    restarts = dict(cluster.restarts)
    affinity = os.sched_getaffinity(next(p for p in cluster.instances if p.name == "decode").pid)
    with requests.post(f"{cluster.endpoint}/v1/completions", json=body, stream=True, timeout=300) as response:
        assert response.status_code == 200, response.text
        lines = response.iter_lines(chunk_size=None)
        for line in lines:
            if line.startswith(b"data: {"):
                events.append(json.loads(line[6:]))
            if killed is None and sum(len(e["choices"][0]["token_ids"]) for e in events if e["choices"]) >= 10:
                killed = kill(cluster, "decode")
            if line == b"data: [DONE]":
                break
        else:
            pytest.fail("the stream ended without [DONE]")
    assert killed is not None, "the stream finished before D could be killed"
    choices = [e["choices"][0] for e in events if e["choices"]]
    assert len({e["id"] for e in events}) == 1 and choices[-1]["finish_reason"] == "length"
    result = compare_greedy(expected, [parse_stream(events)])
    assert result.ok, result.summary()
    assert events[-1]["usage"] == {"prompt_tokens": len(prompt), "completion_tokens": LONG,
                                   "total_tokens": len(prompt) + LONG}
    assert metric(front_metrics(cluster), "pdserve:requests_continued_total") >= continued + 1
    wait_back(cluster, "decode", killed)
    # the supervisor (`pdserve up`'s default, restart on failure) brought back D alone: the killed
    # process group gone, the new one on the same core
    assert UpOptions().restart == cluster.restart == "on-failure"
    assert group_members(killed) == []
    assert os.sched_getaffinity(next(p for p in cluster.instances if p.name == "decode").pid) == affinity
    assert cluster.restarts == {**restarts, "decode": restarts["decode"] + 1}


def test_prefill_killed_requests_fall_back_to_decode(cluster, reference):
    before = front_metrics(cluster)
    killed = kill(cluster, "prefill")
    outputs = greedy(cluster.endpoint, cluster, PROMPTS, concurrency=4)  # raises on any error
    result = compare_greedy(reference[0], outputs)
    assert result.ok, result.summary()
    after = front_metrics(cluster)
    bypassed = (metric(after, "pdserve:requests_routed_around_total") - metric(before, "pdserve:requests_routed_around_total")
                + metric(after, "pdserve:requests_retried_total") - metric(before, "pdserve:requests_retried_total"))
    assert bypassed >= len(PROMPTS), after
    wait_back(cluster, "prefill", killed)


def test_both_dead_is_a_clear_503(cluster):
    kill(cluster, "prefill")
    kill(cluster, "decode")
    time.sleep(1)
    body = {"model": model_name(cluster), "prompt": PROMPTS[0], "max_tokens": MAX_TOKENS}
    response = requests.post(f"{cluster.endpoint}/v1/completions", json=body, timeout=60)
    assert response.status_code == 503, response.text
    error = response.json()["error"]
    assert error["code"] == 503 and "instance" in error["message"], error
