"""Following a streamed generation and continuing it where it broke off (front/continuation.py), on
events shaped as vLLM 0.32 streams them."""

import json

import pytest
import requests
from aiohttp import web

from pdserve.bench.samples import parse_samples
from pdserve.front.body import RequestBody
from pdserve.front.continuation import Follow
from tests.unit.front.fake_upstream import FakeUpstream, running, serve_raw

BASE = 27460  # 27460-27489: a test's front on BASE + 10k, its fakes on the ports after it

HEAD = {"id": "cmpl-1", "created": 7, "model": "m"}


def completion_event(index=0, text="", ids=(), finish=None, prompt_ids=None, logprobs=None) -> bytes:
    choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish, "token_ids": list(ids)}
    if prompt_ids is not None:
        choice["prompt_token_ids"] = list(prompt_ids)
    return b"data: " + json.dumps({**HEAD, "object": "text_completion", "choices": [choice]}).encode() + b"\n\n"


def chat_event(content=None, ids=(), finish=None, prompt_ids=None, role=None) -> bytes:
    delta = {k: v for k, v in (("role", role), ("content", content)) if v is not None}
    data = {**HEAD, "object": "chat.completion.chunk",
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish,
                         "token_ids": list(ids)}]}
    if prompt_ids is not None:
        data["prompt_token_ids"] = list(prompt_ids)
    return b"data: " + json.dumps(data).encode() + b"\n\n"


def events(out: bytes) -> list:
    return [e[len(b"data: "):].decode() if e == b"data: [DONE]" else json.loads(e[len(b"data: "):])
            for e in out.split(b"\n\n") if e]


def start(path: str, raw: bytes):
    return Follow.start("POST", path, RequestBody.parse(raw))


def follow(path="/v1/completions", **request):
    body = {"model": "m", "prompt": "hi", "stream": True, "max_tokens": 8, "temperature": 0, **request}
    return start(path, json.dumps(body).encode())


def test_only_streamed_generations_it_can_continue_are_followed():
    assert follow() is not None and follow(path="/v1/chat/completions", messages=[]) is not None
    assert start("/v1/completions", b'{"prompt": "hi", "stream": false}') is None
    assert start("/v1/embeddings", b'{"input": "hi", "stream": true}') is None
    assert start("/v1/completions", b'{"stream": true, not json') is None
    for refused in (dict(stop=["\n"]), dict(echo=True), dict(best_of=2), dict(prompt=["a", "b"]),
                    dict(use_beam_search=True), dict(guided_json={"type": "object"}),
                    dict(response_format={"type": "json_object"}), dict(truncate_prompt_tokens=5)):
        assert follow(**refused) is None, refused
    for refused in (dict(tools=[{"type": "function"}]), dict(logprobs=True)):
        assert follow(path="/v1/chat/completions", messages=[], **refused) is None, refused


def test_token_ids_are_asked_of_the_upstream_and_taken_out_for_the_client():
    f = follow()
    assert json.loads(f.upstream_body.raw)["return_token_ids"] is True
    stream = completion_event(text="a", ids=[5], prompt_ids=[1, 2, 3]) + completion_event(text="b", ids=[6])
    out = b"".join(f.feed(stream[i:i + 7]) for i in range(0, len(stream), 7))  # events split anywhere
    first, second = events(out)
    assert "prompt_token_ids" not in first["choices"][0] and "token_ids" not in second["choices"][0]
    assert first["choices"][0]["text"] == "a" and f.prompt_ids == [1, 2, 3] and f.choices[0].ids == [5, 6]
    asked = follow(return_token_ids=True)
    assert asked.upstream_body.raw == json.dumps({"model": "m", "prompt": "hi", "stream": True, "max_tokens": 8,
                                              "temperature": 0, "return_token_ids": True}).encode()
    assert asked.feed(stream) == stream  # relayed as it came


def test_a_broken_stream_continues_from_the_ids_streamed_with_the_tokens_left():
    f = follow(temperature=0.5, seed=9, stream_options={"include_usage": True}, min_tokens=4)
    f.feed(completion_event(text="a", ids=[5], prompt_ids=[1, 2, 3]) + completion_event(text="bc", ids=[6, 7]))
    assert f.unfinished() == [0]
    body = json.loads(f.continuation(0))
    assert body["prompt"] == [1, 2, 3, 5, 6, 7] and body["max_tokens"] == 5 and body["min_tokens"] == 1
    assert (body["temperature"], body["seed"], body["n"], body["stream"]) == (0.5, 9, 1, True)
    assert body["stream_options"] == {"include_usage": False} and "echo" not in body
    spliced = f.feed_continuation(0, completion_event(text="d", ids=[8]) + completion_event(text="e", ids=[9], finish="length")
                                  + b"data: " + json.dumps({**HEAD, "choices": [], "usage": {"prompt_tokens": 6}}).encode()
                                  + b"\n\ndata: [DONE]\n\n")
    d, e = events(spliced)  # its usage and [DONE] left out
    assert d == {**HEAD, "object": "text_completion", "choices": [{"index": 0, "text": "d", "logprobs": None,
                                                                  "finish_reason": None}]}
    assert e["choices"][0]["finish_reason"] == "length" and f.unfinished() == []
    usage, done = events(f.closing())
    assert usage["usage"] == {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8} and done == "[DONE]"


def test_a_stream_that_ended_with_done_or_never_started_is_not_continued():
    f = follow()
    f.feed(completion_event(text="a", ids=[5], prompt_ids=[1]) + b"data: [DONE]\n\n")
    assert f.done and f.unfinished() == []
    assert follow().unfinished() == []  # nothing arrived: nothing reached the client either


def test_an_error_event_after_tokens_is_held_back_and_the_stream_continued():
    f = follow()
    error = b'data: {"error": {"message": "boom", "code": 500}}\n\n'
    out = f.feed(completion_event(text="a", ids=[5], prompt_ids=[1]) + error + b"data: [DONE]\n\n")
    assert len(events(out)) == 1 and f.unfinished() == [0] and not f.done
    # the continuation failed too: the client gets the original error, then [DONE]
    assert f.closing("unused") == error + b"data: [DONE]\n\n"
    g = follow()
    g.feed(completion_event(text="a", ids=[5], prompt_ids=[1]))
    failure, done = events(g.closing("no live instance"))
    assert failure["error"]["message"] == "no live instance" and failure["error"]["code"] == 503 and done == "[DONE]"


def test_continued_logprobs_offsets_follow_the_text_already_streamed():
    f = follow(logprobs=1)
    f.feed(completion_event(text="abc", ids=[5], prompt_ids=[1]))
    assert json.loads(f.continuation(0))["logprobs"] == 1
    logprobs = {"text_offset": [0, 2], "tokens": ["de", "f"], "token_logprobs": [-1.0, -2.0], "top_logprobs": None}
    (event,) = events(f.feed_continuation(0, completion_event(text="def", ids=[6, 7], logprobs=logprobs)))
    assert event["choices"][0]["logprobs"]["text_offset"] == [3, 5]


def test_each_unfinished_choice_of_n_continues_on_its_own():
    f = follow(n=2, max_tokens=4)
    f.feed(completion_event(0, "a", [5], prompt_ids=[1, 2]) + completion_event(1, "b", [6], prompt_ids=[1, 2])
           + completion_event(0, "c", [7, 8, 9], finish="length"))
    assert f.unfinished() == [1]
    body = json.loads(f.continuation(1))
    assert body["prompt"] == [1, 2, 6] and body["max_tokens"] == 3 and body["n"] == 1
    (event,) = events(f.feed_continuation(1, completion_event(0, "x", [10, 11, 12], finish="length")))
    assert event["choices"][0]["index"] == 1 and f.unfinished() == []


def test_a_chat_stream_continues_as_chat_chunks():
    f = follow(path="/v1/chat/completions", messages=[{"role": "user", "content": "hi"}], max_tokens=None,
               max_completion_tokens=6, stream_options={"include_usage": True})
    out = f.feed(chat_event(role="assistant", content="", prompt_ids=[1, 2, 3, 4]) + chat_event("Hel", [7]))
    role, hel = events(out)
    assert "prompt_token_ids" not in role and "token_ids" not in hel["choices"][0]
    body = json.loads(f.continuation(0))
    assert body["prompt"] == [1, 2, 3, 4, 7] and body["max_tokens"] == 5 and "messages" not in body
    (event,) = events(f.feed_continuation(0, completion_event(text="lo", ids=[8, 9, 10, 11, 12], finish="length")))
    assert event["object"] == "chat.completion.chunk" and event["choices"][0]["delta"] == {"content": "lo"}
    assert event["choices"][0]["finish_reason"] == "length"
    usage, _ = events(f.closing())
    assert usage["object"] == "chat.completion.chunk"
    assert usage["usage"] == {"prompt_tokens": 4, "completion_tokens": 6, "total_tokens": 10}


def broken_stream(*events: bytes) -> bytes:
    """An SSE answer in chunked encoding whose connection closes after `events` (no last chunk, no [DONE])."""
    head = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
    return head + b"".join(b"%x\r\n%s\r\n" % (len(e), e) for e in events)


def client_events(run, body: dict) -> tuple[list, bytes]:
    with requests.post(f"{run.url}/v1/completions", json=body, stream=True, timeout=20) as response:
        assert response.status_code == 200, response.text
        raw = response.raw.read()
    return events(raw), raw


def test_the_front_continues_a_stream_the_router_broke_off_on_a_live_instance():
    router = BASE + 9
    with running(BASE, upstream_port=router, instances=(("decode", BASE + 2), ("prefill", BASE + 3))) as run:
        server = run.call(serve_raw(router, broken_stream(completion_event(text="a", ids=[5], prompt_ids=[1, 2, 3]),
                                                          completion_event(text="b", ids=[6]))))
        for fake in run.instances.values():
            fake.completion_events = [completion_event(text="c", ids=[7]),
                                      completion_event(text="d", ids=[8], finish="length")]
        try:
            body = {"model": "m", "prompt": "hi", "max_tokens": 4, "temperature": 0, "stream": True,
                    "stream_options": {"include_usage": True}}
            got, _ = client_events(run, body)
        finally:
            server.close()
        assert [e["choices"][0]["text"] for e in got[:4]] == ["a", "b", "c", "d"]
        assert all("token_ids" not in e["choices"][0] for e in got[:4])  # the client did not ask for them
        assert got[4]["usage"] == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}
        assert got[5] == "[DONE]" and len(got) == 6
        (continued,) = [json.loads(b) for fake in run.instances.values() for b in fake.bodies]
        assert continued["prompt"] == [1, 2, 3, 5, 6] and continued["max_tokens"] == 2
        samples = parse_samples(requests.get(f"{run.url}/metrics", timeout=10).text)
        assert samples["pdserve:requests_continued_total"] == 1


def test_a_stream_whose_continuation_fails_ends_in_an_error_event():
    router = BASE + 19
    with running(BASE + 10, upstream_port=router, instances=(("decode", BASE + 12),)) as run:
        server = run.call(serve_raw(router, broken_stream(completion_event(text="a", ids=[5], prompt_ids=[1]))))
        run.instances["decode"].status = 500  # healthy, but fails the continuation
        try:
            got, _ = client_events(run, {"model": "m", "prompt": "hi", "max_tokens": 4, "stream": True})
        finally:
            server.close()
        text, error, done = got
        assert text["choices"][0]["text"] == "a" and done == "[DONE]"
        assert error["error"]["code"] == 503 and "the continuation on the decode answered 500" in error["error"]["message"]


def test_each_unfinished_choice_of_n_is_continued_through_the_front():
    router = BASE + 9 + 20
    with running(BASE + 20, upstream_port=router, instances=(("decode", BASE + 22),)) as run:
        server = run.call(serve_raw(router, broken_stream(
            completion_event(0, "a", [5], prompt_ids=[1, 2]), completion_event(1, "b", [6], prompt_ids=[1, 2]),
            completion_event(0, "c", [7], finish="length"))))
        run.instances["decode"].completion_events = [completion_event(0, "x", [8], finish="length")]
        try:
            got, _ = client_events(run, {"model": "m", "prompt": "hi", "max_tokens": 2, "n": 2, "stream": True})
        finally:
            server.close()
        assert [(e["choices"][0]["index"], e["choices"][0]["text"]) for e in got[:-1]] == [
            (0, "a"), (1, "b"), (0, "c"), (1, "x")]
        assert got[-1] == "[DONE]"
        (continued,) = [json.loads(b) for b in run.instances["decode"].bodies]
        assert continued["prompt"] == [1, 2, 6] and continued["max_tokens"] == 1 and continued["n"] == 1


# -- budgets counted from the tokens already sent; what cannot be continued exactly is refused ----------


def broken_after(f, *ids: int, prompt_ids=(1, 2, 3)):
    """`f` fed one event per token id (a completion's or a chat's), the stream then broken."""
    for i, token in enumerate(ids):
        first = {"prompt_ids": prompt_ids} if i == 0 else {}
        f.feed(completion_event(text="t", ids=[token], **first) if f.path == "/v1/completions"
               else chat_event(content="t", ids=[token], **first))
    return f


def test_a_completion_without_max_tokens_continues_with_what_is_left_of_vllms_16():
    for absent in ({}, {"max_tokens": None}):
        f = broken_after(follow(**{"max_tokens": None, **absent}), 5, 6, 7)
        assert not f.needs_max_model_len
        body = json.loads(f.continuation(0))
        assert body["max_tokens"] == 16 - 3 and body["prompt"] == [1, 2, 3, 5, 6, 7]


def test_a_chat_without_a_limit_continues_up_to_max_model_len():
    messages = [{"role": "user", "content": "hi"}]
    f = broken_after(follow(path="/v1/chat/completions", messages=messages, max_tokens=None), 5, 6)
    assert f.needs_max_model_len
    assert json.loads(f.continuation(0, max_model_len=100))["max_tokens"] == 100 - 3 - 2
    g = broken_after(follow(path="/v1/chat/completions", messages=messages, max_tokens=10,
                            max_completion_tokens=None), 5, 6)  # a null max_completion_tokens: max_tokens holds
    assert not g.needs_max_model_len and json.loads(g.continuation(0))["max_tokens"] == 8


def test_min_tokens_counts_the_tokens_already_sent_within_what_is_left():
    f = broken_after(follow(max_tokens=None, min_tokens=10), 5, 6, 7, 8)
    body = json.loads(f.continuation(0))
    assert (body["min_tokens"], body["max_tokens"]) == (6, 12)
    g = broken_after(follow(max_tokens=6, min_tokens=6), 5, 6, 7, 8, 9)
    assert (json.loads(g.continuation(0))["min_tokens"], json.loads(g.continuation(0))["max_tokens"]) == (1, 1)


def test_a_choice_whose_budget_was_spent_at_the_break_ends_with_length():
    f = broken_after(follow(max_tokens=2), 5, 6)  # its last event had no finish_reason yet
    assert f.unfinished() == [0] and f.continuation(0) is None
    (event,) = events(f.finish(0))
    assert event["choices"][0]["finish_reason"] == "length" and event["choices"][0]["text"] == ""
    assert f.unfinished() == [] and events(f.closing()) == ["[DONE]"]


@pytest.mark.parametrize("penalty", ["frequency_penalty", "presence_penalty"])
def test_penalties_are_refused_at_the_break_with_an_error_event_never_other_tokens(penalty):
    f = broken_after(follow(**{penalty: 0.5}), 5, 6)
    reason = f.refusal(0)
    assert reason.startswith("the stream broke off after 2 tokens of choice 0") and penalty in reason
    f.held_error = b'data: {"error": {"message": "boom"}}\n\n'  # the refusal's reason wins over the break's
    error, done = events(f.closing(reason, refused=True))
    assert error["error"]["message"] == reason and error["error"]["code"] == 503 and done == "[DONE]"
    assert broken_after(follow(**{penalty: 0}), 5).refusal(0) is None  # no penalty: continued


def test_a_chat_choice_is_continued_only_once_its_content_started_and_its_reasoning_ended():
    def chat(*deltas, **request):
        f = follow(path="/v1/chat/completions", messages=[], **request)
        f.feed(chat_event(role="assistant", content="", prompt_ids=[1, 2]))
        for i, delta in enumerate(deltas):
            data = {**HEAD, "object": "chat.completion.chunk",
                    "choices": [{"index": 0, "delta": delta, "finish_reason": None, "token_ids": [10 + i]}]}
            f.feed(b"data: " + json.dumps(data).encode() + b"\n\n")
        return f.refusal(0)

    assert "inside its reasoning" in chat({"reasoning": "let me"})
    assert "inside its reasoning" in chat({"reasoning_content": "let me"})
    assert chat({"reasoning": "let me"}, {"content": "Yes"}) is None  # reasoning over: the rest is content
    assert "before its content started" in chat()
    assert chat({"content": "Yes"}) is None
    assert "include_reasoning" in chat({"content": "Yes"}, include_reasoning=False)


def test_choices_are_made_as_their_events_arrive_not_sized_by_n():
    f = follow(n=16384)
    assert f.choices == {}
    f.feed(completion_event(3, "a", [5], prompt_ids=[1]) + completion_event(20000, "x", [6]))  # out of range: ignored
    assert set(f.choices) == {3} and len(f.unfinished()) == 16384
    body = json.loads(f.continuation(0))  # a choice that sent nothing continues from the prompt alone
    assert body["prompt"] == [1] and body["max_tokens"] == 8


def test_the_front_continues_a_chat_without_a_limit_up_to_the_instances_max_model_len(monkeypatch):
    handle = FakeUpstream.handle

    async def with_max_model_len(self, request):  # vLLM's model card names max_model_len
        if request.path == "/v1/models":
            return web.json_response({"object": "list", "data": [{"id": "m", "max_model_len": 64}]})
        return await handle(self, request)

    monkeypatch.setattr(FakeUpstream, "handle", with_max_model_len)
    router = BASE + 9 + 40
    with running(BASE + 40, upstream_port=router, instances=(("decode", BASE + 42),)) as run:
        server = run.call(serve_raw(router, broken_stream(chat_event(role="assistant", content="", prompt_ids=[1] * 10),
                                                          chat_event("a", [5]), chat_event("b", [6]))))
        run.instances["decode"].completion_events = [completion_event(text="c", ids=[7], finish="length")]
        try:
            with requests.post(f"{run.url}/v1/chat/completions", stream=True, timeout=20,
                               json={"model": "m", "messages": [], "stream": True}) as response:
                got = events(response.raw.read())
        finally:
            server.close()
        assert [e["choices"][0]["delta"].get("content") for e in got[1:4]] == ["a", "b", "c"] and got[-1] == "[DONE]"
        (continued,) = [json.loads(b) for b in run.instances["decode"].bodies]
        assert continued["max_tokens"] == 64 - 10 - 2 and continued["prompt"] == [1] * 10 + [5, 6]


def test_the_front_ends_a_stream_it_cannot_continue_exactly_with_an_error_event():
    router = BASE + 9 + 50
    with running(BASE + 50, upstream_port=router, instances=(("decode", BASE + 52),)) as run:
        server = run.call(serve_raw(router, broken_stream(completion_event(text="a", ids=[5], prompt_ids=[1]))))
        try:
            got, _ = client_events(run, {"model": "m", "prompt": "hi", "max_tokens": 4, "stream": True,
                                         "frequency_penalty": 1.0})
        finally:
            server.close()
        text, error, done = got
        assert text["choices"][0]["text"] == "a" and done == "[DONE]"
        assert "frequency_penalty" in error["error"]["message"]
        assert run.instances["decode"].bodies == []  # nothing was continued


def test_a_client_that_said_no_to_token_ids_is_followed_with_them_asked_for_and_taken_out():
    f = follow(return_token_ids=False)
    assert not f.wants_ids and json.loads(f.upstream_body.raw)["return_token_ids"] is True
    (event,) = events(f.feed(completion_event(text="a", ids=[5], prompt_ids=[1])))
    assert "token_ids" not in event["choices"][0]
