"""Availability through the front (write mode, tiny model, instances restarted on failure): a
request survives the death of the instance serving it, and a stream continued after it equals an
uninterrupted run, token by token.

In order, on the shared write deployment (pool.py), with two deaths of D and one of P:
- D SIGKILLed once while every stream below is in flight (`decode_killed`): a long completion
  (continued on P, its tokens those of an uninterrupted collocated run, its usage whole) and the
  continuation cases, each compared with the same request served uninterrupted by the deployment
  once D is back: max_tokens absent (a completion: vLLM's 16; a chat: up to max_model_len),
  min_tokens counted from the tokens already sent, n > 1 (greedy through top_k 1), and
  frequency/presence penalties, which cannot be continued exactly: that stream ends with an error
  event naming them after the tokens an uninterrupted run gives, never with other tokens. The
  supervisor restarts D alone, on its core.
- P SIGKILLed: requests sent right after fall back to D, greedy outputs equal collocated serving;
  D, asked to take KV from it (announcing its blocks to the dead P), answers with an error or the
  right tokens within its deadline and serves on; then, while P is still down, D SIGKILLed too: an OpenAI-shaped 503. The pool waits until both are
  back and KV moves through the router again before the next module.
"""

from __future__ import annotations

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
    check_decode_after_prefill_died,
    collocated_reference,
    greedy,
    model_name,
    prompts,
    reference_server,
)
from tests.integration.pool import kill, shared, wait_back
from tests.integration.streams import MAX_MODEL_LEN, Stream, cases, start, wait_until

pytestmark = pytest.mark.integration

PROMPTS = prompts(8, seed=77)
LONG = 200  # tokens of the long completion broken mid-way
TOKENS_BEFORE_KILL = 2  # each continuation case has at least this many tokens (each choice one) when D is killed
LONG_BEFORE_KILL = 10  # and the long completion this many


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


def continued_total(cluster) -> float:
    return metric(front_metrics(cluster), "pdserve:requests_continued_total")


class DecodeKilled:
    """What one SIGKILL of D with every stream in flight left: the streams, their token counts at the
    kill, the front's continuation count before it, D's core and restart count before it, the killed
    pid, and the continuation cases served again, uninterrupted, once D was back."""

    def __init__(self, cluster) -> None:
        model, url = model_name(cluster), cluster.endpoint
        self.long = Stream("/v1/completions", {
            "model": model, "prompt": PROMPTS[3], "max_tokens": LONG, "temperature": 0, "logprobs": 2,
            "return_token_ids": True, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}})
        self.broken = cases(model)
        self.restarts = dict(cluster.restarts)
        self.affinity = os.sched_getaffinity(self._decode_pid(cluster))
        *early, last = self.broken.values()
        threads = [start(stream, url) for stream in (self.long, *early)]
        wait_until(lambda: all(s.fewest_tokens() >= TOKENS_BEFORE_KILL or s.failure for s in early)
                   and (self.long.fewest_tokens() >= LONG_BEFORE_KILL or self.long.failure),
                   "the long streams never started")
        threads.append(start(last, url))
        wait_until(lambda: last.fewest_tokens() >= TOKENS_BEFORE_KILL or last.failure, "the short stream never started")
        self.continued_before = continued_total(cluster)
        self.at_kill = {name: {i: len(ids) for i, ids in s.ids.items()}
                        for name, s in {**self.broken, "long": self.long}.items()}
        self.killed = kill(cluster, "decode")
        for thread in threads:
            thread.join(300)
        assert not any(t.is_alive() for t in threads), "a continued stream never ended"
        self.continued_after = continued_total(cluster)
        wait_back(cluster, "decode", self.killed)
        self.reference = cases(model)
        for thread in [start(stream, url) for stream in self.reference.values()]:
            thread.join(300)

    @staticmethod
    def _decode_pid(cluster) -> int:
        return next(p for p in cluster.instances if p.name == "decode").pid


@pytest.fixture(scope="module")
def decode_killed(cluster) -> DecodeKilled:
    return DecodeKilled(cluster)


def test_decode_killed_mid_stream_continues_on_prefill(decode_killed, reference):
    stream, expected = decode_killed.long, reference[1]
    assert not stream.failure and stream.done, stream.failure or "no [DONE]"
    assert decode_killed.at_kill["long"][0] < LONG, "the stream finished before D was killed"
    choices = [c for e in stream.events for c in e.get("choices") or ()]
    assert len({e["id"] for e in stream.events}) == 1 and choices[-1]["finish_reason"] == "length"
    result = compare_greedy(expected, [parse_stream(stream.events)])
    assert result.ok, result.summary()
    prompt = PROMPTS[3]
    assert stream.events[-1]["usage"] == {"prompt_tokens": len(prompt), "completion_tokens": LONG,
                                          "total_tokens": len(prompt) + LONG}


def test_the_supervisor_restarted_decode_alone_on_its_core(cluster, decode_killed):
    # `pdserve up`'s default, restart on failure, brought back D alone: the killed process group gone,
    # the new one on the same core
    assert UpOptions().restart == cluster.restart == "on-failure"
    assert group_members(decode_killed.killed) == []
    assert os.sched_getaffinity(DecodeKilled._decode_pid(cluster)) == decode_killed.affinity
    assert cluster.restarts == {**decode_killed.restarts, "decode": decode_killed.restarts["decode"] + 1}


def test_continued_streams_equal_uninterrupted_runs(decode_killed):
    broken, reference, at_kill = decode_killed.broken, decode_killed.reference, decode_killed.at_kill
    for name, stream in broken.items():
        assert not stream.failure and stream.done, f"{name}: {stream.failure or 'no [DONE]'}"
        assert len(stream.ids) == stream.num_choices, f"{name}: {sorted(stream.ids)}"
        assert len({e["id"] for e in stream.events if "id" in e}) == 1, f"{name}: the stream changed its id"
        assert min(at_kill[name].values()) < min(len(ids) for ids in stream.ids.values()) or stream.errors, (
            f"{name}: finished before D was killed ({at_kill[name]}): not a continuation")
    for name, stream in reference.items():
        assert not stream.failure and stream.done and not stream.errors, f"reference {name}: {stream.failure}"

    for name in ("chat, no max_tokens", "chat, min_tokens, no max_tokens"):  # chat: no logprobs, ids exactly
        got, expected = broken[name], reference[name]
        assert not got.errors, f"{name}: {got.errors}"
        assert got.ids == expected.ids, f"{name}: continued tokens differ from the uninterrupted run's"
        assert got.finish == expected.finish, f"{name}: {got.finish} != {expected.finish}"
    for name in ("completion, n=3 (top_k 1)", "completion, no max_tokens"):  # equal but at a near-tie (compare.py)
        got, expected = broken[name], reference[name]
        assert not got.errors, f"{name}: {got.errors}"
        indices = range(got.num_choices)
        result = compare_greedy([expected.generation(i) for i in indices], [got.generation(i) for i in indices])
        assert result.ok, f"{name} (D killed after {at_kill[name]} tokens): {result.summary()}"
        assert got.finish == expected.finish, f"{name}: {got.finish} != {expected.finish}"
    assert len(reference["completion, no max_tokens"].ids[0]) == 16  # vLLM's completions default
    chat = reference["chat, no max_tokens"]
    assert chat.finish == {0: "length"} and len(chat.prompt_ids) + len(chat.ids[0]) == MAX_MODEL_LEN  # vLLM's chat default

    refused, expected = broken["completion, penalties"], reference["completion, penalties"]
    (error,) = refused.errors
    assert "frequency_penalty" in error["message"] and error["code"] == 503, error
    sent = refused.generation(0)  # the tokens sent are right, and no others
    result = compare_greedy([expected.generation(0)[:len(sent)]], [sent])
    assert result.ok, f"completion, penalties: {result.summary()}"
    assert refused.finish == {}
    # every choice of the continued cases and the long completion went on on P (the refused one did not)
    assert decode_killed.continued_after - decode_killed.continued_before >= 3 + 1 + 1 + 1 + 1


def test_prefill_killed_requests_fall_back_to_decode_then_both_dead_is_a_clear_503(cluster, reference,
                                                                                     greedy_reference):
    pd40 = collocated_reference(greedy_reference, "pd40", prompts())  # test_pd_serving's prompts and answers
    before = front_metrics(cluster)
    killed = kill(cluster, "prefill")
    # requests sent right after the death fall back to D
    outputs = greedy(cluster.endpoint, cluster, PROMPTS, concurrency=4)  # raises on any error
    result = compare_greedy(reference[0], outputs)
    assert result.ok, result.summary()
    after = front_metrics(cluster)
    bypassed = (metric(after, "pdserve:requests_routed_around_total") - metric(before, "pdserve:requests_routed_around_total")
                + metric(after, "pdserve:requests_retried_total") - metric(before, "pdserve:requests_retried_total"))
    assert bypassed >= len(PROMPTS), after

    # D announces its blocks to the dead P (a transfer the router began before the death; where P is back
    # already, its new incarnation refuses the unknown transfer and D recomputes)
    params = {"do_remote_prefill": True, "transfer_id": "tx-kill-p", "remote_host": "127.0.0.1",
              "remote_handshake_port": cluster.port + 5, "remote_notify_port": cluster.port + 6}
    check_decode_after_prefill_died(cluster, params, prompts()[5], pd40[5], pd40)
    # both dead: P is still down (or, where it came back already, killed again), then D
    if next(p for p in cluster.instances if p.name == "prefill").pid != killed:
        kill(cluster, "prefill")
    kill(cluster, "decode")
    time.sleep(1)
    body = {"model": model_name(cluster), "prompt": PROMPTS[0], "max_tokens": MAX_TOKENS}
    response = requests.post(f"{cluster.endpoint}/v1/completions", json=body, timeout=60)
    assert response.status_code == 503, response.text
    error = response.json()["error"]
    assert error["code"] == 503 and "instance" in error["message"], error
