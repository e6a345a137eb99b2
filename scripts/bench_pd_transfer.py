"""KV transfer cost of pdserve's write and read modes, against plain prefill and memcpy.

For each mode (one brought up at a time: P on core 0, D on core 1, vllm-router in front), a warm-up
and then N requests of fresh random token ids (prefix caching is on, so no prompt is ever reused),
one at a time. Per request:

  - PD TTFT: streaming /v1/completions through the router (max_tokens 16, temperature 0,
    ignore_eos), time to the first SSE chunk with choices, measured in this process;
  - plain TTFT: a prompt of the same length sent straight to P without kv_transfer_params (a
    non-disaggregated request on one instance and one core): the baseline PD TTFT is compared with;
  - P's prefill time: delta of P's `vllm:request_prefill_time_seconds` sum/count around the PD
    request (vLLM's own measure, scheduled-to-first-token, without HTTP, queueing or the transfer),
    and the same around the plain request, so P's prefill with and without a transfer compare;
  - the transfer: deltas of the pdserve counters on P and D around the PD request. The copy
    bandwidth is kv_copy_bytes / kv_copy_seconds on the side whose transport copies (P writes in
    write mode, D reads in read mode); announce-to-done is kv_transfer_seconds / completed.
    kv_copy_seconds sums each batch's submit-to-completion time, not CPU busy time: in write mode
    P submits one batch per layer during its forward, and the copy thread shares P's one core with
    it, so the write-mode figure includes waiting for the core and is a lower bound on bandwidth.

After each mode's cluster is stopped, the baseline in this process: np.copyto of one request's KV
bytes, scattered in blocks of one layer's KV block (block_size x kv_heads x 2 x head_dim x 2 bytes)
between random block slots of a 2x larger pool into a pre-faulted destination, and contiguous.

Compiled mode (no --enforce-eager) is the default: it is how vLLM is deployed and eager prefill on
this CPU is markedly slower, which would inflate every prefill and TTFT next to the transfer. The
price is ~60 s more start-up per mode (torch.compile; partly cached under .cache/). --enforce-eager
is there for a quick check. Other processes share the 2 cores: figures are medians over the
requests with their [min..max] spread.

    .venv/bin/python scripts/bench_pd_transfer.py [--requests 8] [--tokens 2000] [--modes write read]
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import sys
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import requests
from prometheus_client.parser import text_string_to_metric_families

from pdserve import launch
from pdserve.launch import UpOptions
from pdserve.model.build import resolve_model

COPY_SIDE = {"write": "prefill", "read": "decode"}  # whose transport copies the blocks
PD_COUNTERS = ("completed", "failed", "bytes", "seconds", "copy_bytes", "copy_seconds")
PROMETHEUS = {
    "completed": "pdserve:kv_transfers_completed_total",
    "failed": "pdserve:kv_transfers_failed_total",
    "bytes": "pdserve:kv_transfer_bytes_total",
    "seconds": "pdserve:kv_transfer_seconds_total",
    "copy_bytes": "pdserve:kv_copy_bytes_total",
    "copy_seconds": "pdserve:kv_copy_seconds_total",
    "prefill_sum": "vllm:request_prefill_time_seconds_sum",
    "prefill_count": "vllm:request_prefill_time_seconds_count",
}
SETTLE_TIMEOUT = 10.0  # counters reach /metrics with the engine's next stats update


@dataclass(frozen=True)
class Sample:
    """One measured PD request and its plain twin."""

    pd_ttft: float
    plain_ttft: float
    prefill: float  # P's histogram delta around the PD request; nan when it did not move
    plain_prefill: float  # the same around the plain request
    p: dict[str, float]  # counter deltas on P
    d: dict[str, float]  # counter deltas on D


def scrape(url: str) -> dict[str, float]:
    """The counters above, summed over label sets."""
    text = requests.get(f"{url}/metrics", timeout=30).text
    wanted = {v: k for k, v in PROMETHEUS.items()}
    values = dict.fromkeys(PROMETHEUS, 0.0)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in wanted:
                values[wanted[sample.name]] += sample.value
    return values


def block_size(url: str) -> int:
    text = requests.get(f"{url}/metrics", timeout=30).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "vllm:cache_config_info":
                return int(sample.labels["block_size"])
    raise RuntimeError("vllm:cache_config_info not on /metrics")


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before[k] for k in after}


def stream_ttft(url: str, model: str, prompt: list[int], max_tokens: int, timeout: float = 300) -> float:
    """Seconds to the first streamed chunk with choices; checks all max_tokens tokens arrive."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    first = None
    usage = None
    with requests.post(f"{url}/v1/completions", json=body, stream=True, timeout=timeout) as response:
        if response.status_code != 200:
            raise RuntimeError(f"{url}: HTTP {response.status_code}: {response.text[:300]}")
        for line in response.iter_lines(chunk_size=None):
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices") and first is None:
                first = time.perf_counter() - start
            usage = chunk.get("usage") or usage
    if first is None or not usage or usage["completion_tokens"] != max_tokens:
        raise RuntimeError(f"{url}: stream ended early (first chunk {first}, usage {usage})")
    return first


def settled(url: str, before: dict[str, float], key: str, deadline: float) -> dict[str, float]:
    """Scrape until counter `key` moved past `before` (or the deadline passed)."""
    while True:
        now = scrape(url)
        if now[key] > before[key] or time.monotonic() > deadline:
            return now
        time.sleep(0.1)


def mean_prefill(counters: dict[str, float]) -> float:
    return ratio(counters["prefill_sum"], counters["prefill_count"]) if counters["prefill_count"] else float("nan")


def spread(values: list[float], scale: float = 1.0, fmt: str = ".1f") -> str:
    values = [v * scale for v in values if v == v]
    if not values:
        return "n/a"
    return f"{statistics.median(values):{fmt}} [{min(values):{fmt}}..{max(values):{fmt}}]"


def ratio(num: float, den: float) -> float:
    return num / den if den else float("nan")


class Prompts:
    """Fresh random token ids (never 0-2: bos/eos/pad of the built-in models)."""

    def __init__(self, seed: int, num_tokens: int, vocab_size: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.num_tokens, self.vocab_size = num_tokens, vocab_size

    def next(self) -> list[int]:
        return self.rng.integers(3, self.vocab_size, self.num_tokens).tolist()


def wait_routable(endpoint: str, model: str, prompts: Prompts, max_tokens: int, timeout: float = 120) -> float:
    """The warm-up request, retried while the router has no registered P/D pair yet (503)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return stream_ttft(endpoint, model, prompts.next(), max_tokens)
        except RuntimeError as exc:
            if time.monotonic() > deadline:
                raise
            print(f"  warm-up retry: {exc}", flush=True)
            time.sleep(2)


def measure_mode(mode: str, args: argparse.Namespace, prompts: Prompts, port: int) -> tuple[list[Sample], int]:
    """Bring `mode` up, warm it up, measure args.requests requests; returns them and the KV block size."""
    options = UpOptions(mode=mode, model=str(args.model_dir), port=port, enforce_eager=args.enforce_eager,
                        log_dir=args.log_dir / mode if args.log_dir else None)
    started = time.monotonic()
    with launch.up(options) as cluster:
        cluster.wait_healthy(600)
        urls = cluster.instance_urls
        p_url, d_url = urls["prefill"], urls["decode"]
        model = requests.get(f"{p_url}/v1/models", timeout=30).json()["data"][0]["id"]
        kv_block_size = block_size(p_url)
        print(f"{mode}: healthy after {time.monotonic() - started:.0f} s; KV block size {kv_block_size}", flush=True)
        warm = wait_routable(cluster.endpoint, model, prompts, args.max_tokens)
        warm_plain = stream_ttft(p_url, model, prompts.next(), args.max_tokens)
        print(f"{mode}: warm-up PD TTFT {warm * 1e3:.0f} ms, plain {warm_plain * 1e3:.0f} ms", flush=True)
        copier = p_url if COPY_SIDE[mode] == "prefill" else d_url
        samples = []
        for i in range(args.requests):
            time.sleep(0.5)  # let the previous request's stats reach /metrics
            p0, d0 = scrape(p_url), scrape(d_url)
            pd_ttft = stream_ttft(cluster.endpoint, model, prompts.next(), args.max_tokens)
            deadline = time.monotonic() + SETTLE_TIMEOUT
            c0 = p0 if copier == p_url else d0
            settled(copier, c0, "copy_bytes", deadline)
            p1 = settled(p_url, p0, "prefill_count", deadline)
            d1 = settled(d_url, d0, "completed", deadline)
            p1 = settled(p_url, p0, "completed", deadline) if p1["completed"] <= p0["completed"] else p1
            p, d = delta(p1, p0), delta(d1, d0)
            plain = stream_ttft(p_url, model, prompts.next(), args.max_tokens)
            p2 = settled(p_url, p1, "prefill_count", time.monotonic() + SETTLE_TIMEOUT)
            sample = Sample(pd_ttft, plain, mean_prefill(p), mean_prefill(delta(p2, p1)), p, d)
            samples.append(sample)
            print_sample(mode, i, sample)
    return samples, kv_block_size


def print_sample(mode: str, i: int, s: Sample) -> None:
    c = s.p if COPY_SIDE[mode] == "prefill" else s.d
    print(f"  {mode} #{i}: PD TTFT {s.pd_ttft * 1e3:6.0f} ms | plain TTFT {s.plain_ttft * 1e3:6.0f} ms | "
          f"P prefill PD {s.prefill * 1e3:6.0f} plain {s.plain_prefill * 1e3:6.0f} ms | copied {c['copy_bytes'] / 1e6:6.2f} MB in "
          f"{c['copy_seconds'] * 1e3:6.2f} ms = {ratio(c['copy_bytes'], c['copy_seconds']) / 1e9:5.2f} GB/s | "
          f"announce-to-done P {ratio(s.p['seconds'], s.p['completed']) * 1e3:6.1f} ms "
          f"D {ratio(s.d['seconds'], s.d['completed']) * 1e3:6.1f} ms | "
          f"completed P/D {s.p['completed']:.0f}/{s.d['completed']:.0f} failed {s.p['failed'] + s.d['failed']:.0f}",
          flush=True)


def memcpy_gbs(num_bytes: int, block_bytes: int, seed: int, rounds: int = 7) -> tuple[float, float]:
    """(scattered, contiguous) GB/s, median of `rounds` after one warm-up, for one request's KV."""
    num_blocks = max(1, num_bytes // block_bytes)
    rng = np.random.default_rng(seed)
    src_ids = rng.choice(2 * num_blocks, num_blocks, replace=False)
    dst_ids = rng.permutation(num_blocks)
    pool = np.ones(2 * num_blocks * block_bytes, dtype=np.uint8)
    dst = np.zeros(num_blocks * block_bytes, dtype=np.uint8)
    dst[:] = 2  # pre-fault
    pairs = [(int(d) * block_bytes, int(s) * block_bytes) for d, s in zip(dst_ids, src_ids)]

    def scattered() -> None:
        for d, s in pairs:
            np.copyto(dst[d: d + block_bytes], pool[s: s + block_bytes])

    def contiguous() -> None:
        np.copyto(dst, pool[: dst.size])

    result = []
    for copy in (scattered, contiguous):
        times = []
        for _ in range(rounds + 1):
            start = time.perf_counter()
            copy()
            times.append(time.perf_counter() - start)
        result.append(dst.size / statistics.median(times[1:]) / 1e9)
    return result[0], result[1]


def block_bytes(model_dir: Path, size: int) -> int:
    """Bytes of one layer's KV for one block: [kv_heads, block_size, 2 * head_dim] in bf16."""
    config = json.loads((model_dir / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return config["num_key_value_heads"] * size * 2 * head_dim * 2


def summarize(mode: str, samples: list[Sample], chunk: int, seed: int) -> str:
    """Runs the memcpy baseline for this mode's bytes per request; returns the summary line."""
    side = COPY_SIDE[mode]
    copies = [s.p if side == "prefill" else s.d for s in samples]
    gbs = [ratio(c["copy_bytes"], c["copy_seconds"]) / 1e9 for c in copies if c["copy_seconds"]]
    per_request = statistics.median([c["copy_bytes"] for c in copies]) if copies else 0
    scattered, contiguous = memcpy_gbs(int(per_request), chunk, seed) if per_request else (float("nan"),) * 2
    failed = sum(s.p["failed"] + s.d["failed"] for s in samples)
    missing = sum(1 for c in copies if not c["copy_bytes"])
    print(f"{mode}: memcpy of {per_request / 1e6:.2f} MB in {chunk // 1024} KiB blocks: "
          f"scattered {scattered:.2f} GB/s, contiguous {contiguous:.2f} GB/s", flush=True)
    med = statistics.median(gbs) if gbs else float("nan")
    return (f"SUMMARY {mode:5s} n={len(samples)}: "
            f"P prefill {spread([s.prefill for s in samples], 1e3, '.0f')} ms vs plain "
            f"{spread([s.plain_prefill for s in samples], 1e3, '.0f')} ms | "
            f"PD TTFT {spread([s.pd_ttft for s in samples], 1e3, '.0f')} ms vs plain "
            f"{spread([s.plain_ttft for s in samples], 1e3, '.0f')} ms (paired PD-plain "
            f"{spread([s.pd_ttft - s.plain_ttft for s in samples], 1e3, '+.0f')} ms; PD TTFT - P prefill "
            f"{spread([s.pd_ttft - s.prefill for s in samples], 1e3, '.0f')} ms) | "
            f"{per_request / 1e6:.2f} MB/req copied by {side[0].upper()} in "
            f"{spread([c['copy_seconds'] for c in copies if c['copy_bytes']], 1e3, '.2f')} ms = "
            f"{spread(gbs, 1, '.2f')} GB/s = {med / scattered:.0%} of scattered memcpy "
            f"({med / contiguous:.0%} of contiguous) | announce-to-done P "
            f"{spread([ratio(s.p['seconds'], s.p['completed']) for s in samples], 1e3, '.1f')} ms, D "
            f"{spread([ratio(s.d['seconds'], s.d['completed']) for s in samples], 1e3, '.1f')} ms | "
            f"failed {failed:.0f}, no copy seen {missing}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="small")
    parser.add_argument("--tokens", type=int, default=2000, help="prompt length in tokens")
    parser.add_argument("--requests", type=int, default=8, help="measured requests per mode")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--modes", nargs="+", default=["write", "read"], choices=["write", "read"])
    parser.add_argument("--port", type=int, default=48100, help="base port; each mode takes the next 20")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--log-dir", type=Path, default=None, help="keep the vLLM/router logs here")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind through the cluster's __exit__
    print(f"bench_pd_transfer {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC: model {args.model}, "
          f"{args.tokens}-token prompts, {args.requests} requests/mode, max_tokens {args.max_tokens}, "
          f"{'eager' if args.enforce_eager else 'compiled'}, seed {args.seed}", flush=True)
    args.model_dir = resolve_model(args.model)
    vocab_size = json.loads((args.model_dir / "config.json").read_text())["vocab_size"]
    summaries = []
    for index, mode in enumerate(args.modes):
        prompts = Prompts(args.seed + index, args.tokens, vocab_size)
        samples, kv_block_size = measure_mode(mode, args, prompts, args.port + 20 * index)
        summaries.append(summarize(mode, samples, block_bytes(args.model_dir, kv_block_size), args.seed))
    print("\n".join(summaries))


if __name__ == "__main__":
    main()
