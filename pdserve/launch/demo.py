"""The demo's client session: streaming completions, each request's TTFT and mean inter-token latency."""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass

import requests

from pdserve.model.corpus_gen import generate

MAX_TOKENS = 32


@dataclass(frozen=True)
class RequestTiming:
    prompt_chars: int
    num_tokens: int
    ttft_s: float
    mean_itl_s: float
    kv_bytes: float = 0.0  # KV moved from prefill to decode for this request (PD modes)


def model_id(url: str) -> str:
    """The served model's id, as GET /v1/models lists it."""
    response = requests.get(f"{url}/v1/models", timeout=30)
    response.raise_for_status()
    return response.json()["data"][0]["id"]


def kv_bytes_received(decode_url: str | None) -> float:
    """The decode instance's `pdserve:kv_transfer_bytes_total`; 0 without a decode instance."""
    if decode_url is None:
        return 0.0
    text = requests.get(f"{decode_url}/metrics", timeout=30).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("pdserve:kv_transfer_bytes_total"))


def stream_completion(endpoint: str, model: str, prompt: str, max_tokens: int = MAX_TOKENS) -> RequestTiming:
    """One streaming request; token times are the arrival times of SSE chunks with text
    (a chunk can hold no text while a multi-byte character is incomplete)."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    arrivals: list[float] = []
    num_tokens = 0
    with requests.post(f"{endpoint}/v1/completions", json=body, stream=True, timeout=120) as response:
        response.raise_for_status()
        for line in response.iter_lines(chunk_size=None):
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                num_tokens = chunk["usage"]["completion_tokens"]
            if chunk["choices"] and chunk["choices"][0].get("text"):
                arrivals.append(time.perf_counter())
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
    return RequestTiming(len(prompt), num_tokens, arrivals[0] - start if arrivals else float("nan"),
                         statistics.fmean(gaps) if gaps else float("nan"))


def demo_prompts(count: int) -> list[str]:
    """Prompts of growing length cut from the corpus generator (distinct, so no prefix-cache hits)."""
    text = generate(seed=7, kib=64)["prose.txt"]
    return [text[i * 997: i * 997 + 200 + 400 * i] for i in range(count)]


def client_session(endpoint: str, num_requests: int, instance_urls: dict[str, str] | None = None) -> list[RequestTiming]:
    model = model_id(endpoint)
    decode_url = (instance_urls or {}).get("decode")
    timings = []
    for i, prompt in enumerate(demo_prompts(num_requests)):
        before = kv_bytes_received(decode_url)
        t = stream_completion(endpoint, model, prompt)
        t = RequestTiming(t.prompt_chars, t.num_tokens, t.ttft_s, t.mean_itl_s, kv_bytes_received(decode_url) - before)
        timings.append(t)
        moved = f", KV moved {t.kv_bytes / 2**20:6.2f} MiB" if decode_url else ""
        print(f"request {i + 1}: prompt {t.prompt_chars:5d} chars, {t.num_tokens} tokens, "
              f"TTFT {t.ttft_s * 1e3:7.1f} ms, mean ITL {t.mean_itl_s * 1e3:6.1f} ms{moved}", flush=True)
    return timings
