"""What the front adds to a request's latency: `pdserve up --mode write --model tiny`, the same
requests sent to the front and straight to its router, interleaved so both paths see the same
machine state (pairs in alternating order), over kept-alive connections on both paths.

    sequential   small completions one after another: total latency
    concurrent   rounds of 64 streaming completions at once: time to first token and total

Reports p50/p99 per path and the front's added latency (front - router) with a 95% bootstrap
interval over the pairs. Writes benchmarks/front-latency/report.md and results.json.

    .venv/bin/python scripts/front_latency.py [--sequential 200] [--concurrency 64] [--rounds 16]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import numpy as np
import requests

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pdserve.launch import UpOptions, up  # noqa: E402

OUT = ROOT / "benchmarks" / "front-latency"
PROMPT = "The old sailor carried the rope to the harbor"
SEED = 38
BOOTSTRAP_SAMPLES = 2000
WARMUP_REQUESTS = 10
SETTINGS = ("sequential", "concurrency", "rounds", "max_tokens")  # the flags a result depends on


@dataclass(frozen=True)
class Sample:
    """One request: seconds to its first streamed piece (None when not streamed) and to its end."""

    first: float | None
    total: float


async def request(session: aiohttp.ClientSession, url: str, body: dict) -> Sample:
    start = time.perf_counter()
    first = None
    async with session.post(f"{url}/v1/completions", json=body) as response:
        if response.status != 200:
            raise RuntimeError(f"{url}: HTTP {response.status}: {await response.text()}")
        async for _ in response.content.iter_any():
            if first is None:
                first = time.perf_counter() - start
    return Sample(first if body.get("stream") else None, time.perf_counter() - start)


async def sequential(sessions: dict[str, aiohttp.ClientSession], urls: dict[str, str], body: dict, count: int,
                     rng: random.Random) -> dict[str, list[Sample]]:
    """`count` pairs, one request per path each, in random order within the pair."""
    samples: dict[str, list[Sample]] = {path: [] for path in urls}
    for _ in range(count):
        order = list(urls)
        rng.shuffle(order)
        for path in order:
            samples[path].append(await request(sessions[path], urls[path], body))
    return samples


async def concurrent(sessions: dict[str, aiohttp.ClientSession], urls: dict[str, str], body: dict, concurrency: int,
                     rounds: int) -> dict[str, list[Sample]]:
    """`rounds` rounds per path of `concurrency` requests at once, the paths alternating ABBA."""
    samples: dict[str, list[Sample]] = {path: [] for path in urls}
    paths = list(urls)
    for round_index in range(rounds):
        order = paths if round_index % 2 == 0 else paths[::-1]
        for path in order:
            burst = [request(sessions[path], urls[path], body) for _ in range(concurrency)]
            samples[path] += await asyncio.gather(*burst)
    return samples


def percentile(values: np.ndarray, q: float) -> float:
    return float(np.percentile(values, q))


def added(front: list[float], router: list[float], q: float, rng: np.random.Generator) -> dict[str, float]:
    """Front minus router at percentile `q`, in ms, with a 95% bootstrap interval over the pairs."""
    front_a, router_a = np.asarray(front), np.asarray(router)
    point = percentile(front_a, q) - percentile(router_a, q)
    picks = rng.integers(0, len(front_a), size=(BOOTSTRAP_SAMPLES, len(front_a)))
    spread = np.percentile(front_a[picks], q, axis=1) - np.percentile(router_a[picks], q, axis=1)
    low, high = np.percentile(spread, [2.5, 97.5])
    return {"ms": 1000 * point, "low_ms": 1000 * float(low), "high_ms": 1000 * float(high)}


def summarize(samples: dict[str, list[Sample]], metric: str, rng: np.random.Generator) -> dict:
    values = {path: [getattr(s, metric) for s in samples[path]] for path in samples}
    result = {path: {"p50_ms": 1000 * percentile(np.asarray(v), 50), "p99_ms": 1000 * percentile(np.asarray(v), 99),
                     "n": len(v)} for path, v in values.items()}
    result["added"] = {f"p{q}": added(values["front"], values["router"], q, rng) for q in (50, 99)}
    return result


def report_md(results: dict) -> str:
    lines = ["# The front's added latency", "",
             f"`pdserve up --mode write --model tiny` on {results['machine']}, {results['date']}; the same requests "
             "to the front and straight to its router, interleaved, kept-alive connections on both paths. "
             "Added = front - router, 95% bootstrap interval over the pairs. 1-minute load average "
             f"{results['load_average'][0]:.1f} before, {results['load_average'][1]:.1f} after (everything on the "
             "machine, the deployment and this script included). Produced by `scripts/front_latency.py`.",
             "", "| measurement | router p50 | front p50 | added p50 | router p99 | front p99 | added p99 |",
             "|---|---|---|---|---|---|---|"]
    for name, summary in results["summaries"].items():
        a50, a99 = summary["added"]["p50"], summary["added"]["p99"]
        lines.append(f"| {name} | {summary['router']['p50_ms']:.1f} ms | {summary['front']['p50_ms']:.1f} ms | "
                     f"{a50['ms']:+.2f} ms [{a50['low_ms']:+.2f}, {a50['high_ms']:+.2f}] | "
                     f"{summary['router']['p99_ms']:.1f} ms | {summary['front']['p99_ms']:.1f} ms | "
                     f"{a99['ms']:+.2f} ms [{a99['low_ms']:+.2f}, {a99['high_ms']:+.2f}] |")
    settings = results["settings"]
    lines += ["", f"Sequential: {settings['sequential']} pairs of a {settings['max_tokens']}-token completion. "
              f"Concurrent: {settings['rounds']} rounds per path of {settings['concurrency']} streaming "
              f"{settings['max_tokens']}-token completions at once (ABBA order).", ""]
    return "\n".join(lines)


async def measure(urls: dict[str, str], model: str, args: argparse.Namespace) -> dict:
    small = {"model": model, "prompt": PROMPT, "max_tokens": args.max_tokens, "temperature": 0, "ignore_eos": True}
    streamed = {**small, "stream": True}
    rng = random.Random(SEED)
    timeout = aiohttp.ClientTimeout(total=600)
    connector = {path: aiohttp.TCPConnector(limit=args.concurrency, keepalive_timeout=4) for path in urls}
    sessions = {path: aiohttp.ClientSession(connector=connector[path], timeout=timeout) for path in urls}
    try:
        await sequential(sessions, urls, small, WARMUP_REQUESTS, rng)
        await concurrent(sessions, urls, streamed, args.concurrency, 1)
        runs = {"sequential total": (await sequential(sessions, urls, small, args.sequential, rng), "total")}
        bursts = await concurrent(sessions, urls, streamed, args.concurrency, args.rounds)
        runs[f"{args.concurrency} concurrent streams, TTFT"] = (bursts, "first")
        runs[f"{args.concurrency} concurrent streams, total"] = (bursts, "total")
    finally:
        for session in sessions.values():
            await session.close()
    stats_rng = np.random.default_rng(SEED)
    return {name: summarize(samples, metric, stats_rng) for name, (samples, metric) in runs.items()}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--sequential", type=int, default=200, help="pairs of sequential requests (default 200)")
    p.add_argument("--concurrency", type=int, default=64, help="streaming requests at once (default 64)")
    p.add_argument("--rounds", type=int, default=16, help="concurrent rounds per path (default 16)")
    p.add_argument("--max-tokens", type=int, default=8, help="tokens per completion (default 8)")
    p.add_argument("--port", type=int, default=29700, help="the front's port; the deployment uses the next ones")
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args()
    for flag in ("sequential", "concurrency", "rounds", "max_tokens"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be at least 1")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the deployment is stopped on the way out
    cluster = up(UpOptions(mode="write", model="tiny", port=args.port, enforce_eager=True, kv_cache_bytes=512 << 20))
    try:
        cluster.wait_healthy(900)
        assert cluster.deployment.router is not None
        urls = {"front": cluster.endpoint, "router": cluster.deployment.router.url}
        model = _wait_routable(cluster.endpoint)
        load_before = os.getloadavg()[0]
        summaries = asyncio.run(measure(urls, model, args))
        load_after = os.getloadavg()[0]
    finally:
        cluster.stop()
    results = {"machine": _machine(),
               "date": time.strftime("%Y-%m-%d", time.gmtime()), "settings": {key: getattr(args, key) for key in SETTINGS},
               "load_average": [load_before, load_after], "summaries": summaries}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    (args.out / "report.md").write_text(report_md(results))
    seq, ttft = summaries["sequential total"]["added"], summaries[f"{args.concurrency} concurrent streams, TTFT"]["added"]
    print(f"front added: sequential p50 {seq['p50']['ms']:+.2f} ms p99 {seq['p99']['ms']:+.2f} ms; "
          f"{args.concurrency} streams TTFT p50 {ttft['p50']['ms']:+.2f} ms p99 {ttft['p99']['ms']:+.2f} ms")
    return 0


def _machine() -> str:
    models = [line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
              if line.startswith("model name")]
    return f"{models[0] if models else platform.machine()}, {os.cpu_count()} CPUs"


def _wait_routable(endpoint: str, timeout: float = 300) -> str:
    """The served model, once a completion passes through the endpoint (P and D registered)."""
    deadline = time.monotonic() + timeout
    model = requests.get(f"{endpoint}/v1/models", timeout=30).json()["data"][0]["id"]
    while requests.post(f"{endpoint}/v1/completions", json={"model": model, "prompt": [11, 12], "max_tokens": 1},
                        timeout=60).status_code != 200:
        if time.monotonic() > deadline:
            raise RuntimeError("the router never routed a request")
        time.sleep(0.5)
    return model


if __name__ == "__main__":
    raise SystemExit(main())
