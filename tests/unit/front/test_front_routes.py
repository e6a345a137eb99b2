"""Which upstream the front picks: a completion with echo and logprobs goes whole to a direct
instance (in turn) where the front has any, everything else to its upstream."""

import json

import pytest
import requests

from pdserve.front.body import RequestBody
from pdserve.front.routes import merge_unsafe
from tests.unit.front.fake_upstream import running

BASE = 27150  # 27150-27159
ECHO = {"model": "m", "prompt": "hi", "echo": True, "logprobs": 1}


@pytest.mark.parametrize("method, path, body, unsafe", [
    ("POST", "/v1/completions", ECHO, True),
    ("POST", "/v1/completions", {**ECHO, "logprobs": 0, "stream": True}, True),
    ("POST", "/v1/completions", {**ECHO, "logprobs": None}, False),
    ("POST", "/v1/completions", {**ECHO, "echo": False}, False),
    ("POST", "/v1/completions", {"model": "m", "prompt": "echo", "logprobs": 1}, False),
    ("POST", "/v1/chat/completions", ECHO, False),
    ("GET", "/v1/completions", ECHO, False),
    ("POST", "/v1/completions", '{"echo": true, ', False),
    ("POST", "/v1/completions", ["echo"], False),
    ("POST", "/v1/completions", '{"\\u0065cho": true, "logprobs": 1}', True),  # the key JSON-escaped
])
def test_only_a_completion_with_echo_and_logprobs_is_merge_unsafe(method, path, body, unsafe):
    raw = body.encode() if isinstance(body, str) else json.dumps(body).encode()
    assert merge_unsafe(method, path, RequestBody.parse(raw)) is unsafe


def test_echo_with_logprobs_goes_to_the_direct_instances_in_turn():
    with running(BASE, direct=(BASE + 2, BASE + 3)) as run:
        def answered_by(body: dict) -> str:
            response = requests.post(f"{run.url}/v1/completions", json=body, timeout=10)
            assert response.status_code == 200, response.text
            assert json.loads(response.json()["body"]) == body  # the request as the client sent it
            return response.json()["upstream"]

        assert [answered_by(ECHO) for _ in range(4)] == [f"direct{BASE + 2}", f"direct{BASE + 3}"] * 2
        assert answered_by({**ECHO, "logprobs": None}) == "upstream"
        assert answered_by({"model": "m", "prompt": "hi"}) == "upstream"


def test_without_direct_instances_echo_goes_to_the_upstream():
    with running(BASE + 5) as run:
        response = requests.post(f"{run.url}/v1/completions", json=ECHO, timeout=10)
        assert response.status_code == 200 and response.json()["upstream"] == "upstream"
