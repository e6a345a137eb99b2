"""`echo` with `logprobs` through the front: the shared write and read deployments (pool.py) answer
each completion, streamed or not, as the session's collocated reference does (the front sends it
whole to the decode instance; vllm-router's merge of the two legs would list the prompt twice)."""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass, field

import pytest
import requests

from tests.integration.pd_helpers import model_name, reference_server
from tests.integration.pool import shared
from tests.integration.request_shapes import LOGPROB_TOLERANCE

pytestmark = pytest.mark.integration

MAX_TOKENS = 6
_rng = random.Random(38)
PROMPTS = {
    "short text": "The old sailor carried the rope to the harbor",
    "16 tokens": [_rng.randrange(10, 4000) for _ in range(16)],  # one KV block, exactly
    "128 tokens": [_rng.randrange(10, 4000) for _ in range(128)],
    "300 tokens": [_rng.randrange(10, 4000) for _ in range(300)],
}
CASES = [(name, logprobs, stream) for name in PROMPTS for logprobs in (1, 3) for stream in (False, True)]


@dataclass
class Echo:
    """A completion's echoed answer, streamed pieces joined."""

    text: str = ""
    tokens: list[str] = field(default_factory=list)
    token_logprobs: list[float | None] = field(default_factory=list)
    text_offset: list[int] = field(default_factory=list)
    top_tokens: list[set[str]] = field(default_factory=list)  # the tokens of each position's top_logprobs

    def add(self, choice: dict) -> None:
        self.text += choice["text"]
        logprobs = choice.get("logprobs") or {}
        self.tokens += logprobs.get("tokens") or []
        self.token_logprobs += logprobs.get("token_logprobs") or []
        self.text_offset += logprobs.get("text_offset") or []
        self.top_tokens += [set(top or ()) for top in logprobs.get("top_logprobs") or []]


def ask(endpoint: str, model: str, prompt, logprobs: int, stream: bool) -> Echo:
    body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
            "echo": True, "logprobs": logprobs, "stream": stream}
    echo = Echo()
    with requests.post(f"{endpoint}/v1/completions", json=body, stream=stream, timeout=300) as response:
        assert response.status_code == 200, response.text
        if not stream:
            echo.add(response.json()["choices"][0])
            return echo
        lines = [line for line in response.iter_lines(chunk_size=None) if line.startswith(b"data: ")]
    assert lines[-1] == b"data: [DONE]"
    for line in lines[:-1]:
        chunk = json.loads(line[6:])
        for choice in chunk["choices"]:
            echo.add(choice)
    return echo


def answers(cluster) -> dict[tuple, Echo]:
    model = model_name(cluster)
    if cluster.deployment.router is not None:
        decode = [(i.name, i.url) for i in cluster.deployment.instances if i.role == "decode"]
        assert cluster.deployment.front.direct_sources == tuple(decode)
    return {case: ask(cluster.endpoint, model, PROMPTS[case[0]], *case[1:]) for case in CASES}


pd = shared("pd-write", "pd-read")


@pytest.fixture(scope="module")
def collocated(greedy_reference) -> dict[tuple, Echo]:
    if "echo" not in greedy_reference:
        greedy_reference["echo"] = answers(reference_server(greedy_reference))
    return greedy_reference["echo"]


def check_equal(got: Echo, want: Echo, case: tuple) -> None:
    assert got.tokens == want.tokens, (case, got.tokens[:8], want.tokens[:8])
    assert got.text == want.text, case
    assert got.text_offset == want.text_offset, case
    assert len(got.token_logprobs) == len(want.token_logprobs), case
    for position, (a, b) in enumerate(zip(got.token_logprobs, want.token_logprobs)):
        assert (a is None) == (b is None), (case, position, a, b)
        assert a is None or math.isclose(a, b, abs_tol=LOGPROB_TOLERANCE), (case, position, a, b)
    assert len(got.top_tokens) == len(want.top_tokens), case


def test_echo_with_logprobs_answers_as_collocated(pd, collocated):
    for case, want in collocated.items():
        prompt = PROMPTS[case[0]]
        if isinstance(prompt, list):  # the prompt once, then the completion: nothing repeated
            assert len(want.tokens) == len(prompt) + MAX_TOKENS, (case, len(want.tokens))
    got = answers(pd)
    for case, want in collocated.items():
        check_equal(got[case], want, case)
