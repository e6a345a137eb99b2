"""What PDConnector costs a decode step: a PD instance against plain vLLM, on the same machine.

A disaggregated stream's inter-token latency is its decode instance's step. The connector must not
make that step slower than plain vLLM's, or every PD configuration pays it on every token. This
probe runs two instances of the small model, one per core: plain vLLM, and the same vLLM with
PDConnector as a decode instance (kv_consumer, no peer; the requests it serves are plain ones, so
only what the connector does per step and in its threads differs). Variants of the second:

* ``pd``: the connector as deployed (transport auto);
* ``pd-agent``: transport nixl, so a NIXL agent runs as it did under auto before it started lazily
  (nixl_auto.py): its UCX progress thread wakes every millisecond.

Each round sends both instances, one after the other, STREAMS concurrent 16-token prompts that
decode TOKENS tokens each, and takes their mean ITL. Rounds alternate which instance goes first,
and each variant runs twice with the two instances' cores swapped, so neither order nor core
favours one. It prints, per variant, both medians and the paired difference (variant minus plain,
same round) with a 95 % t-interval. Needs two free cores (nothing else running); ~10 min.

    python scripts/step_overhead_probe.py [--rounds 6] [--out benchmarks/step-overhead]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import threading
import time
from pathlib import Path

import requests
from scipy import stats

from pdserve import launch
from pdserve.launch.modes import Deployment
from pdserve.launch.pd_modes import transfer_config
from pdserve.model.build import resolve_model

VARIANTS = {"pd": {}, "pd-agent": {"transport": "nixl"}}
PROMPT_TOKENS = 16
TIMEOUT_S = 120


def stream_itl(url: str, model: str, seed: int, tokens: int) -> float:
    """Mean ITL of one streamed request: (last chunk - first chunk) / (tokens - 1)."""
    body = {"model": model, "prompt": [100 + (seed * 31 + k) % 7000 for k in range(PROMPT_TOKENS)],
            "max_tokens": tokens, "ignore_eos": True, "temperature": 0, "stream": True}
    chunks = []
    with requests.post(url + "/v1/completions", json=body, stream=True, timeout=TIMEOUT_S) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if line.startswith(b"data: ") and line != b"data: [DONE]":
                chunks.append(time.monotonic())
    if len(chunks) < 2:
        raise RuntimeError(f"{url}: {len(chunks)} chunks streamed")
    return (chunks[-1] - chunks[0]) / (tokens - 1)


def round_itl(url: str, model: str, streams: int, tokens: int, seed: int) -> float:
    """Mean ITL over `streams` concurrent requests."""
    itls: list[float] = []
    threads = [threading.Thread(target=lambda s=s: itls.append(stream_itl(url, model, seed + s, tokens)))
               for s in range(streams)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(TIMEOUT_S)
    if len(itls) != streams:
        raise RuntimeError(f"{url}: a stream failed or did not finish in time")
    return statistics.fmean(itls)


def deployment(variant: str, pd_core: int, port: int) -> Deployment:
    """Plain vLLM and the variant, one per core (`pd_core`: the variant's)."""
    options = launch.UpOptions(mode="round-robin", model="small", restart="never", port=port)
    options = dataclasses.replace(options, model=str(resolve_model(options.model)))
    first, second = launch.plan(options).instances  # two plain instances, on cores 0 and 1
    plain, pd = (second, first) if pd_core == 0 else (first, second)
    config = transfer_config("kv_consumer", "write", pd.port, port + 10, port + 11, port + 12, VARIANTS[variant])
    pd = dataclasses.replace(pd, name=variant, role="decode", extra_args=(*pd.extra_args, "--kv-transfer-config", config))
    return Deployment((plain, pd), None)


def measure(variant: str, pd_core: int, rounds: int, streams: int, tokens: int, port: int) -> list[tuple[float, float]]:
    """(plain, variant) mean ITL per round."""
    plan = deployment(variant, pd_core, port)
    with launch.Cluster(plan, restart="never", startup_timeout=600) as cluster:
        cluster.wait_healthy(600)
        urls = [spec.url for spec in plan.instances]
        model = requests.get(urls[0] + "/v1/models", timeout=TIMEOUT_S).json()["data"][0]["id"]
        for url in urls:
            round_itl(url, model, streams, 32, seed=0)  # warm-up
        pairs = []
        for r in range(rounds):
            order = urls if r % 2 == 0 else urls[::-1]
            itl = {url: round_itl(url, model, streams, tokens, seed=1000 * (r + 1)) for url in order}
            pairs.append((itl[urls[0]], itl[urls[1]]))
            print(f"  {variant} on core {pd_core}, round {r + 1}: plain {1000 * pairs[-1][0]:.2f} ms, "
                  f"{variant} {1000 * pairs[-1][1]:.2f} ms", file=sys.stderr, flush=True)
    return pairs


def summary(pairs: list[tuple[float, float]]) -> dict:
    diffs = [1000 * (v - p) for p, v in pairs]
    mean = statistics.fmean(diffs)
    half = stats.t.ppf(0.975, len(diffs) - 1) * statistics.stdev(diffs) / len(diffs) ** 0.5
    plain = statistics.median(1000 * p for p, _ in pairs)
    return {"plain_ms": round(plain, 2), "variant_ms": round(statistics.median(1000 * v for _, v in pairs), 2),
            "diff_ms": round(mean, 2), "diff_ci_ms": [round(mean - half, 2), round(mean + half, 2)],
            "diff_pct": round(100 * mean / plain, 1), "rounds": len(pairs)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma list of " + ", ".join(VARIANTS))
    parser.add_argument("--rounds", type=int, default=6, help="rounds per core layout (two layouts per variant)")
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=200)
    parser.add_argument("--port", type=int, default=19200)
    parser.add_argument("--out", type=Path, help="directory for result.json")
    args = parser.parse_args()
    result = {"streams": args.streams, "tokens": args.tokens, "variants": {}}
    for variant in args.variants.split(","):
        if variant not in VARIANTS:
            parser.error(f"unknown variant {variant!r} (known: {', '.join(VARIANTS)})")
        pairs = [p for core in (1, 0) for p in measure(variant, core, args.rounds, args.streams, args.tokens, args.port)]
        result["variants"][variant] = summary(pairs)
    print(f"mean ITL of {args.streams} streams x {args.tokens} tokens (medians; difference: variant - plain, "
          f"same round, mean [95 % t-interval])")
    for variant, s in result["variants"].items():
        print(f"  {variant:9s} plain {s['plain_ms']:6.2f} ms  {variant} {s['variant_ms']:6.2f} ms  "
              f"difference {s['diff_ms']:+.2f} [{s['diff_ci_ms'][0]:+.2f}, {s['diff_ci_ms'][1]:+.2f}] ms "
              f"({s['diff_pct']:+.1f} %) over {s['rounds']} rounds")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "result.json").write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
