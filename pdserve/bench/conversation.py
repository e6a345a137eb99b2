"""Multi-turn load: conversations through chat completions, each turn carrying the ones before it.

Conversation i starts at arrival i of the seed's schedule (arrivals.py, the same pattern at every
rate). Its turns follow one another: turn k+1 is sent as soon as turn k's answer is complete, its
messages holding every earlier user message and the model's actual answers, plus a new user
message of about ``input_len`` tokens. Answers are streamed (TTFT, gaps between content chunks)
and forced to ``output_len`` tokens (ignore_eos).

Run as ``python -m pdserve.bench.conversation --base-url ... --model ... --workload JSON --seed S
--rate R --result FILE``; the result has the shape of `vllm bench serve --save-detailed` (requests in
conversation-major order), so records.py reads it unchanged.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from pdserve.bench.arrivals import arrival_times
from pdserve.bench.plan import Workload

TURN_TIMEOUT_S = 600.0


@dataclass
class TurnResult:
    ttft_s: float = 0.0
    itls_s: list[float] = field(default_factory=list)
    error: str = ""
    input_len: int = 0
    output_len: int = 0
    start_s: float = 0.0
    latency_s: float = 0.0


def user_messages(workload: Workload, seed: int, rate: float) -> list[list[str]]:
    """Per conversation, its user messages (prefix caching is on for this kind: a namespace per
    rate keeps one point's conversations out of the next point's cache)."""
    words = _words()
    rng = np.random.default_rng([seed, int(round(rate * 1000)), 0x4D545552])
    num_words = max(1, workload.input_len * 3 // 4)  # about 4/3 tokens per word of English prose
    return [[" ".join(words[i] for i in rng.integers(len(words), size=num_words)) for _ in range(workload.turns)]
            for _ in range(workload.num_prompts)]


def _words() -> list[str]:
    corpus = Path(__file__).resolve().parent.parent / "model" / "corpus" / "prose.txt"
    return sorted({w.strip(".,;:!?\"'()").lower() for w in corpus.read_text().split()} - {""})


async def _turn(session, url: str, model: str, messages: list[dict], output_len: int) -> tuple[TurnResult, str]:
    body = {"model": model, "messages": messages, "max_tokens": output_len, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    result, answer, last, tokens = TurnResult(start_s=time.perf_counter()), [], None, 0
    try:
        async with session.post(url, json=body) as resp:
            if resp.status != 200:
                result.error = f"HTTP {resp.status}: {(await resp.text())[:300]}"
                return result, ""
            async for raw in resp.content:
                line = raw.decode().strip()
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[5:])
                text = "".join((c.get("delta") or {}).get("content") or "" for c in chunk.get("choices") or ())
                answer.append(text)
                usage = chunk.get("usage")
                if usage:
                    result.input_len = int(usage["prompt_tokens"])
                    result.output_len = int(usage["completion_tokens"])
                # a chunk that brings tokens (by the running usage count; tokens may decode to no text)
                if not (result.output_len > tokens if usage else text):
                    continue
                tokens = result.output_len if usage else tokens
                now = time.perf_counter()
                if last is None:
                    result.ttft_s = now - result.start_s
                elif chunk.get("choices"):
                    result.itls_s.append(now - last)
                last = now
    except (OSError, asyncio.TimeoutError, ValueError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    result.latency_s = time.perf_counter() - result.start_s
    if not result.error and last is None:
        result.error = "no tokens"
    return result, "".join(answer)


async def run(base_url: str, model: str, workload: Workload, seed: int, rate: float) -> dict:
    import aiohttp  # lazy: heavy, only the conversation workload's client needs it

    starts = arrival_times(seed, workload.num_prompts, rate, workload.burstiness)
    messages = user_messages(workload, seed, rate)
    url = f"{base_url}/v1/chat/completions"
    t0 = time.perf_counter()

    async def conversation(i: int, session) -> list[TurnResult]:
        await asyncio.sleep(max(0.0, t0 + starts[i] - time.perf_counter()))
        history: list[dict] = []
        out = []
        for text in messages[i]:
            history.append({"role": "user", "content": text})
            result, answer = await _turn(session, url, model, history, workload.output_len)
            out.append(result)
            if result.error:  # the conversation cannot go on without its answer
                out += [TurnResult(error="earlier turn failed") for _ in range(workload.turns - len(out))]
                break
            history.append({"role": "assistant", "content": answer})
        return out

    timeout = aiohttp.ClientTimeout(total=TURN_TIMEOUT_S * workload.turns)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        per_conversation = await asyncio.gather(*(conversation(i, session) for i in range(workload.num_prompts)))
    duration = time.perf_counter() - t0
    turns = [t for conv in per_conversation for t in conv]
    ok = [t for t in turns if not t.error]
    return {
        "duration": duration, "completed": len(ok), "failed": len(turns) - len(ok),
        "request_throughput": len(ok) / duration, "output_throughput": sum(t.output_len for t in ok) / duration,
        "ttfts": [t.ttft_s for t in turns], "itls": [t.itls_s for t in turns], "errors": [t.error for t in turns],
        "output_lens": [t.output_len if not t.error else 0 for t in turns], "input_lens": [t.input_len for t in turns],
        "start_times": [t.start_s for t in turns], "latencies": [t.latency_s for t in turns],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pdserve.bench.conversation")
    p.add_argument("--base-url", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--workload", required=True, help="the Workload as JSON")
    p.add_argument("--seed", type=int, required=True)
    p.add_argument("--rate", type=float, required=True)
    p.add_argument("--result", type=Path, required=True)
    args = p.parse_args(argv)
    workload = Workload(**json.loads(args.workload))
    result = asyncio.run(run(args.base_url, args.model, workload, args.seed, args.rate))
    args.result.write_text(json.dumps(result))
    print(f"{result['completed']} turns completed, {result['failed']} failed in {result['duration']:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
