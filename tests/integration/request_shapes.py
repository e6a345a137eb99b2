"""Requests whose shape disaggregation must handle like plain serving, for every mode's deployment:
`echo` with `logprobs` and `prompt_logprobs` (the answer is built from the whole prompt, so P may
never cut the leg short), and `n > 1` (vLLM splits the request into n children that share one
transfer: the KV moves once, no child waits for a placement or is recomputed)."""

from __future__ import annotations

import math
import random

import requests

from pdserve.compare import compare_greedy, parse_choice
from tests.integration.pd_helpers import MAX_TOKENS, model_name, moved, reference_server, snapshot

ECHO_PROMPT = [random.Random(62).randrange(10, 4000) for _ in range(300)]
LOGPROB_TOLERANCE = 0.05  # another batch on another instance: the same tokens, logprobs equal to rounding
NUM_CHOICES = 3


def _post(cluster, body: dict) -> dict:
    response = requests.post(f"{cluster.endpoint}/v1/completions", timeout=300,
                             json={"model": model_name(cluster), "prompt": ECHO_PROMPT, "max_tokens": 4,
                                   "temperature": 0, "ignore_eos": True, **body})
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]


def prompt_answers(cluster) -> dict:
    """The echo (`echo` + `logprobs`) and the prompt logprobs (`prompt_logprobs` + `logprobs`) of
    ECHO_PROMPT, each with a 200, as the prompt token's logprob at each position."""
    echo = _post(cluster, {"echo": True, "logprobs": 1})
    prompt = _post(cluster, {"prompt_logprobs": 1, "logprobs": 1})["prompt_logprobs"]
    assert len(prompt) == len(ECHO_PROMPT), f"prompt logprobs for {len(prompt)} of {len(ECHO_PROMPT)} tokens"
    return {"echo_text": echo["text"], "echo_tokens": echo["logprobs"]["tokens"],
            "echo_logprobs": echo["logprobs"]["token_logprobs"],
            "prompt_logprobs": [None if entry is None else entry[str(token)]["logprob"]
                                for token, entry in zip(ECHO_PROMPT, prompt)]}


def check_prompt_answers(cluster, cache) -> None:
    """`cluster` answers ECHO_PROMPT's echo and prompt logprobs as a collocated instance does."""
    if "echo-logprobs" not in cache:
        cache["echo-logprobs"] = prompt_answers(reference_server(cache))
    want, got = cache["echo-logprobs"], prompt_answers(cluster)
    # vllm-router's answer to an echo through P and D repeats the prompt before D's echo: its tail is D's
    length = len(want["echo_tokens"])
    assert got["echo_tokens"][-length:] == want["echo_tokens"], (got["echo_tokens"][-8:], want["echo_tokens"][-8:])
    assert got["echo_text"].endswith(want["echo_text"]), (got["echo_text"][-80:], want["echo_text"][-80:])
    got["echo_logprobs"] = [None] + got["echo_logprobs"][-length + 1:]  # the first prompt token has none
    for key in ("echo_logprobs", "prompt_logprobs"):
        assert len(got[key]) == len(want[key]), key
        for position, (a, b) in enumerate(zip(got[key], want[key])):
            assert (a is None) == (b is None), (key, position, a, b)
            assert a is None or math.isclose(a, b, abs_tol=LOGPROB_TOLERANCE), (key, position, a, b)


def check_n_choices(cluster, prompt: list[int], reference) -> None:
    """A request with n = 3 sampled greedily (top_k 1) through `cluster`: every choice equals `reference` (collocated's
    greedy generation of `prompt`), its KV moved at most once, and no child was recomputed on D or
    waited out P's placement wait."""
    before = snapshot(cluster)
    response = requests.post(f"{cluster.endpoint}/v1/completions", timeout=300, json={
        "model": model_name(cluster), "prompt": prompt, "n": NUM_CHOICES, "max_tokens": MAX_TOKENS,
        "temperature": 1.0, "top_k": 1, "seed": 36,  # greedy: vLLM refuses n > 1 at temperature 0
        "logprobs": 2, "return_token_ids": True, "ignore_eos": True})
    assert response.status_code == 200, response.text
    choices = sorted(response.json()["choices"], key=lambda choice: choice["index"])
    result = compare_greedy([reference] * NUM_CHOICES, [parse_choice(choice) for choice in choices])
    assert len(choices) == NUM_CHOICES and result.ok, result.mismatches()
    after = snapshot(cluster)
    delta = lambda side, name, **labels: moved(before, after, side, name, **labels)  # noqa: E731
    assert delta("d", "pdserve:kv_recomputed_total") == 0
    assert delta("p", "pdserve:placements_total", reason="no_word") == 0, "a child waited for D's word"
    assert delta("d", "pdserve:placements_total") == 1, "the request was placed more than once"
    remote = delta("d", "pdserve:placements_total", placement="remote")
    transfers = delta("d", "pdserve:kv_transfers_completed_total")
    assert transfers == remote <= 1, f"placed remote {remote:.0f} times, the KV moved {transfers:.0f} times"
