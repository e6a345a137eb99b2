"""P serving whole requests (serve_decode) through vllm-router, real vLLM (WRITE, adaptive): while
D's streams are loaded (serve_gate.py), P registers as a decode instance too, so the router sends it
a share of the decode legs. Those requests are prefilled and decoded on P, their prefill legs
dropped; the rest go P -> D as usual. Every answer equals collocated serving, P stops taking decode
legs once D is idle again, and nothing is held or leaked afterwards.

The ITL target is set below what D's streams see on any machine (1 ms), so the gate's input is
real (D's measured ITL, published over the control plane) and its outcome certain."""

from __future__ import annotations

import random
import threading
import time

import pytest
import requests

from pdserve.compare import compare_greedy
from pdserve.placement.serve_gate import MIN_OPEN_S
from tests.integration.pd_helpers import (
    collocated_reference,
    greedy,
    metric,
    metrics,
    model_name,
    moved,
    pd_pair,
    prompts,
    snapshot,
    wait_idle,
)
from tests.integration.request_shapes import check_prompt_answers

pytestmark = pytest.mark.integration

PROMPTS = prompts()  # the connector correctness check's 40 prompts (the same reference as test_adaptive)
SERVING = {"placement": "adaptive", "serve_decode": True, "itl_target_ms": 1, "max_step_ms": 50}
ROUTER_FORGETS_S = 12.0  # vllm-router drops an instance 5-6 s after its last beat, in a sweep every ~5 s


@pytest.fixture(scope="module")
def reference(greedy_reference):
    return collocated_reference(greedy_reference, "pd40", PROMPTS)


@pytest.fixture(scope="module")
def serving(reference):
    with pd_pair("write", 32200, **SERVING) as cluster:
        yield cluster


class BackgroundStreams:
    """`width` clients sending short prompts with 48-token answers through the router until stopped:
    D's streams stay loaded. Records every prompt's length (token-id prompts)."""

    def __init__(self, cluster, width: int = 6):
        self._url = f"{cluster.endpoint}/v1/completions"
        self._model = model_name(cluster)
        self._stop = threading.Event()
        self.lengths: list[int] = []
        self.errors: list[str] = []
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(width)]
        for thread in self._threads:
            thread.start()

    def _run(self, seed: int) -> None:
        rng = random.Random(seed)
        while not self._stop.is_set():
            prompt = [rng.randrange(10, 4000) for _ in range(rng.randrange(8, 40))]
            body = {"model": self._model, "prompt": prompt, "max_tokens": 48, "temperature": 0, "ignore_eos": True}
            try:
                response = requests.post(self._url, json=body, timeout=120)
                if response.status_code != 200:
                    self.errors.append(f"{response.status_code}: {response.text[:200]}")
            except requests.RequestException as exc:
                self.errors.append(str(exc))
            self.lengths.append(len(prompt))

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(150)
            assert not thread.is_alive(), "a background client did not finish"


def serving_decode(cluster) -> float:
    return metric(metrics(cluster.prefill_url), "pdserve:serving_decode")


def test_p_serves_a_share_of_whole_requests_while_d_is_loaded_and_every_answer_equals_collocated(serving,
                                                                                              reference):
    before = snapshot(serving)
    background = BackgroundStreams(serving)
    try:
        deadline = time.monotonic() + 60
        while serving_decode(serving) != 1:
            assert time.monotonic() < deadline, "P never offered to serve whole requests with D's streams loaded"
            time.sleep(0.5)
        time.sleep(2.5)  # the router registers P as a decode instance at its next beat (1 s)
        output = greedy(serving.endpoint, serving, PROMPTS)
    finally:
        background.stop()
    assert not background.errors, background.errors[:3]
    result = compare_greedy(reference, output)
    print("serve_decode", result.summary())
    assert result.ok, result.mismatches()

    after = snapshot(serving)
    delta = lambda side, name, **labels: moved(before, after, side, name, **labels)  # noqa: E731
    whole = delta("p", "pdserve:placements_total", placement="whole", reason="serve_decode")
    on_d = delta("d", "pdserve:placements_total")
    requests_sent = len(PROMPTS) + len(background.lengths)
    print(f"requests: {requests_sent}, served whole on P: {whole:.0f}, decoded on D: {on_d:.0f}")
    # while P is registered the router gives each request to the decode instance with fewer in
    # flight (power_of_two of two; ties at random): both take a share of the 40 prompts
    assert whole + on_d == requests_sent and whole >= 5 and on_d >= 5, (whole, on_d)
    remote = delta("d", "pdserve:placements_total", placement="remote")
    assert delta("p", "pdserve:kv_transfers_completed_total") == remote
    assert delta("d", "pdserve:kv_transfers_completed_total") == remote
    assert delta("p", "pdserve:kv_transfers_failed_total") == 0 and delta("d", "pdserve:kv_recomputed_total") == 0
    # every prompt token is computed once, plus at most one token per dropped leg: P never ran a
    # prompt twice for a request it served whole
    computed = delta("p", "vllm:prompt_tokens_by_source_total", source="local_compute") + \
        delta("d", "vllm:prompt_tokens_by_source_total", source="local_compute")
    total = sum(len(p) for p in PROMPTS) + sum(background.lengths)
    print(f"prompt tokens: {total}, computed by P and D together: {computed:.0f}")
    assert computed <= total + 2 * requests_sent


def test_p_stops_taking_decode_legs_once_d_is_idle(serving):
    # D idle: it publishes nothing, so P's gate closes (STALE_S after D's last status, not before
    # MIN_OPEN_S open: at most MIN_OPEN_S after the last test, plus a heartbeat), P stops its decode
    # registration and the router forgets it (ROUTER_FORGETS_S at most)
    time.sleep(MIN_OPEN_S + 1.0 + ROUTER_FORGETS_S)
    # 8 requests at once: the router places all of them before D's first status on them (0.5 s) could
    # reopen the gate (with a 1 ms target, one stream does) and P's next heartbeat register it again
    before = snapshot(serving)
    output = greedy(serving.endpoint, serving, PROMPTS[:8], concurrency=8)
    after = snapshot(serving)
    assert len(output) == 8
    whole = moved(before, after, "p", "pdserve:placements_total", placement="whole", reason="serve_decode")
    assert whole == 0, f"P served {whole:.0f} of 8 requests whole with D idle"
    assert moved(before, after, "d", "pdserve:placements_total") == 8  # every decode leg went to D


def test_echo_and_prompt_logprobs_equal_collocated(serving, greedy_reference):
    check_prompt_answers(serving, greedy_reference)


def test_nothing_is_held_after_serving_whole_requests(serving):
    wait_idle(serving.prefill_url, 60)
    wait_idle(serving.decode_url, 60)
