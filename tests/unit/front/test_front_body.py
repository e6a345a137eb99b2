"""A request body as the front reads it (front/body.py), and what of a client's reaches an instance:
never `kv_transfer_params` or X-Request-ID, on any path (through the router, to a direct instance for
echo with logprobs, around a dead instance, in a resend)."""

import json

import pytest
import requests

from pdserve.front.body import MAX_SEQUENCES, BodyRefused, RequestBody
from tests.unit.front.fake_upstream import running
from tests.unit.front.test_front import openai_error
from tests.unit.front.test_front_fallback import instance_up, wait_for

BASE = 27160  # 27160-27179

KV = {"remote_engine_id": "evil", "remote_block_ids": [1, 2, 3], "do_remote_prefill": True}


def parse(body) -> RequestBody:
    return RequestBody.parse(body if isinstance(body, bytes) else json.dumps(body).encode())


def test_members_are_split_once_and_kv_transfer_params_taken_out_however_spelled():
    body = parse({"model": "m", "prompt": "hi", "kv_transfer_params": KV})
    assert json.loads(body.raw) == {"model": "m", "prompt": "hi"} and not body.has("kv_transfer_params")
    escaped = parse(b'{"model": "m", "\\u006bv_transfer_params": {"a": 1}, "\\u0065cho": true}')
    assert json.loads(escaped.raw) == {"model": "m", "echo": True} and escaped.field("echo") is True
    kept = b'{"model": "m",  "prompt": "hi"}'
    assert parse(kept).raw == kept  # nothing taken out: forwarded byte for byte
    nan = parse(b'{"model": "m", "temperature": NaN, "kv_transfer_params": {}}')  # Python's json reads NaN
    assert nan.raw == b'{"model":"m","temperature":NaN}'
    for not_an_object in (b"x" * 100, b'["echo"]', b'{"a": 1, '):
        assert parse(not_an_object).raw == not_an_object and not parse(not_an_object).is_object


def test_a_large_body_only_an_instance_could_read_as_json_is_refused():
    large = b'{"prompt": "' + b"a" * (2 << 20) + b'", "x": NaN}'
    with pytest.raises(BodyRefused) as refused:
        RequestBody.parse(large, "application/json")
    assert refused.value.error.status == 400
    assert RequestBody.parse(large, "text/plain").raw == large  # not read as JSON by anyone


@pytest.mark.parametrize("name", ["n", "best_of"])
@pytest.mark.parametrize("value", [1_000_000, "x", 0, -1, True, 2.5, [1], {"a": 1}, MAX_SEQUENCES + 1])
def test_sizes_out_of_vllms_bounds_are_a_400_naming_the_field_and_the_rule(name, value):
    with pytest.raises(BodyRefused) as refused:
        parse({"model": "m", "prompt": "hi", name: value})
    error = refused.value.error
    assert error.status == 400 and error.param == name
    assert error.message.startswith(f"{name} must be an integer from 1 to {MAX_SEQUENCES}, got ")


@pytest.mark.parametrize("value", [1, 3, MAX_SEQUENCES, "2", 4.0, None])
def test_sizes_vllm_reads_pass(value):
    assert parse({"model": "m", "n": value, "best_of": value}).is_object


def echoed(response: requests.Response) -> tuple[dict, dict]:
    """The body and headers an upstream fake received, from its echo."""
    assert response.status_code == 200, response.text
    answer = response.json()
    return json.loads(answer["body"]), {k.lower(): v for k, v in answer["headers"]}


def post(run, body: dict, path: str = "/v1/completions") -> tuple[dict, dict, str]:
    response = requests.post(f"{run.url}{path}", json=body, timeout=10, headers={"X-Request-ID": "client-chosen"})
    sent, headers = echoed(response)
    return sent, headers, response.json()["upstream"]


def assert_clean(sent: dict, headers: dict) -> None:
    assert "kv_transfer_params" not in sent and "x-request-id" not in headers, (sent, headers)


def test_no_client_kv_transfer_params_or_request_id_reaches_an_instance_on_any_path():
    body = {"model": "m", "prompt": "hi", "max_tokens": 4, "kv_transfer_params": KV}
    with running(BASE, direct=(BASE + 4,), instances=(("decode", BASE + 2), ("prefill", BASE + 3))) as run:
        sent, headers, upstream = post(run, body)  # through the router
        assert upstream == "upstream" and sent == {k: v for k, v in body.items() if k != "kv_transfer_params"}
        assert_clean(sent, headers)
        sent, headers, upstream = post(run, {**body, "echo": True, "logprobs": 1})  # merge-unsafe: direct
        assert upstream == f"direct{BASE + 4}"
        assert_clean(sent, headers)
        run.upstream.status = 503  # the router fails: resent whole to an instance
        sent, headers, upstream = post(run, body)
        assert upstream in ("decode", "prefill") and run.upstream.served
        assert_clean(sent, headers)
        run.upstream.status = None
        run.stop(run.instances["prefill"])  # an instance down: requests go around the router
        wait_for(lambda: instance_up(run, "prefill") == 0)
        sent, headers, upstream = post(run, body)
        assert upstream == "decode"
        assert_clean(sent, headers)


def test_a_bad_size_is_answered_400_before_anything_is_sent():
    with running(BASE + 6, instances=(("decode", BASE + 8),)) as run:
        for value in (1_000_000, "x"):
            response = requests.post(f"{run.url}/v1/completions", timeout=10,
                                     json={"model": "m", "prompt": "hi", "stream": True, "n": value})
            error = openai_error(response, 400)
            assert error["param"] == "n" and "from 1 to 16384" in error["message"]
        assert run.upstream.served == [] and run.instances["decode"].served == []
