"""What an OpenAI client sees of a `pdserve up` endpoint: the official `openai` client lists the
model and streams exactly max_tokens tokens; errors come back in OpenAI's shape naming their cause."""

from __future__ import annotations

import time

import openai
import requests

MAX_TOKENS = 24
MESSAGES = [{"role": "user", "content": "Where is the bread?"}]


def client(endpoint: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{endpoint}/v1", api_key="unused", max_retries=0, timeout=120)


def wait_routable(endpoint: str, model: str, timeout: float = 120) -> None:
    """vllm-router learns P and D from their registration heartbeats: wait until a request passes."""
    deadline = time.monotonic() + timeout
    while True:
        response = requests.post(f"{endpoint}/v1/completions", json={"model": model, "prompt": [11, 12], "max_tokens": 1},
                                 timeout=60)
        if response.status_code == 200:
            return
        assert time.monotonic() < deadline, f"never routable: {response.status_code} {response.text}"
        time.sleep(0.5)


def check_openai_client(endpoint: str, expected_model: str) -> None:
    """models.list names the model; a streamed chat completion has exactly MAX_TOKENS tokens (one
    logprob entry each, and usage saying so); a plain completion's usage is right too."""
    api = client(endpoint)
    assert [m.id for m in api.models.list().data] == [expected_model]
    stream = api.chat.completions.create(model=expected_model, messages=MESSAGES, max_tokens=MAX_TOKENS,
                                         temperature=0, logprobs=True, stream=True,
                                         stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    chunks = list(stream)
    choices = [c.choices[0] for c in chunks if c.choices]
    streamed = sum(len(c.logprobs.content) for c in choices if c.logprobs and c.logprobs.content)
    assert streamed == MAX_TOKENS, f"{streamed} tokens streamed for max_tokens={MAX_TOKENS}"
    assert "".join(c.delta.content or "" for c in choices)
    assert choices[-1].finish_reason == "length"
    assert chunks[-1].usage.completion_tokens == MAX_TOKENS
    completion = api.completions.create(model=expected_model, prompt="The river", max_tokens=8, temperature=0,
                                        extra_body={"ignore_eos": True})
    assert completion.usage.completion_tokens == 8 and completion.choices[0].text


def _error(response: requests.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    error = response.json()["error"]
    assert error["code"] == status and isinstance(error["message"], str) and error["type"], error
    return error


def check_error_shapes(endpoint: str, model: str) -> None:
    """Unknown model, malformed and ill-typed bodies, an over-long prompt: each an OpenAI error
    whose message names the cause, as the `openai` client and plain HTTP see it."""
    try:
        client(endpoint).chat.completions.create(model="no-such-model", messages=MESSAGES, max_tokens=4)
        raise AssertionError("an unknown model was served")
    except openai.NotFoundError as exc:
        assert exc.status_code == 404 and "no-such-model" in exc.message, exc.message
    url = f"{endpoint}/v1/completions"
    malformed = requests.post(url, data=b'{"model": ', headers={"content-type": "application/json"}, timeout=60)
    assert "Failed to parse the request body as JSON" in _error(malformed, 400)["message"]
    ill_typed = requests.post(url, json={"model": model, "prompt": "hi", "temperature": "hot"}, timeout=60)
    error = _error(ill_typed, 400)
    assert "temperature" in error["message"] and error["type"] == "BadRequestError", error
    too_long = requests.post(url, json={"model": model, "prompt": [11] * 5000, "max_tokens": 4}, timeout=60)
    assert "maximum context length is 4096 tokens" in _error(too_long, 400)["message"]
    too_many = requests.post(url, json={"model": model, "prompt": "hi", "max_tokens": 100000}, timeout=60)
    assert "max_tokens=100000" in _error(too_many, 400)["message"]
