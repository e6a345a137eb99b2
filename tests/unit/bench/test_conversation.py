"""The multi-turn client against a fake chat endpoint (aiohttp.web, streamed SSE)."""

import asyncio
import json

from pdserve.bench.conversation import run, user_messages
from pdserve.bench.plan import Workload
from pdserve.bench.records import records_from_bench


def test_user_messages_are_fixed_by_seed_and_rate():
    w = Workload(input_len=40, output_len=3, num_prompts=2, kind="multi-turn", turns=3)
    first = user_messages(w, 1, 2.0)
    assert first == user_messages(w, 1, 2.0) and len(first) == 2 and all(len(c) == 3 for c in first)
    assert len(first[0][0].split()) == 30
    assert first != user_messages(w, 1, 3.0) and first != user_messages(w, 2, 2.0)


def test_each_turn_carries_the_earlier_turns_and_answers():
    from aiohttp import web

    seen = []

    async def chat(request):
        body = await request.json()
        seen.append(body["messages"])
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        turn = len([m for m in body["messages"] if m["role"] == "user"])
        assert body["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
        for i in range(body["max_tokens"]):
            # the second token decodes to no text: still a token, counted by the running usage
            chunk = {"choices": [{"delta": {"content": "" if i == 1 else f"a{turn}.{i} "}}],
                     "usage": {"prompt_tokens": 10 * turn, "completion_tokens": i + 1}}
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
            await asyncio.sleep(0.01)
        usage = {"choices": [], "usage": {"prompt_tokens": 10 * turn, "completion_tokens": body["max_tokens"]}}
        await resp.write(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())
        return resp

    async def scenario():
        app = web.Application()
        app.router.add_post("/v1/chat/completions", chat)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        try:
            w = Workload(input_len=8, output_len=3, num_prompts=2, kind="multi-turn", turns=2)
            return await run(f"http://127.0.0.1:{port}", "m", w, seed=1, rate=50.0)
        finally:
            await runner.cleanup()

    result = asyncio.run(scenario())
    assert result["failed"] == 0 and result["completed"] == 4
    second_turns = [m for m in seen if len(m) == 3]
    assert len(second_turns) == 2
    for messages in second_turns:
        assert [m["role"] for m in messages] == ["user", "assistant", "user"]
        assert messages[1]["content"] == "a1.0 a1.2 "  # the actual answer of turn 1
    records = records_from_bench(result)
    assert [r.input_len for r in records] == [10, 20, 10, 20]  # conversation-major order
    assert all(r.output_len == 3 and len(r.itl_ms) == 2 and r.ttft_ms > 0 for r in records)
