#!/usr/bin/env python
"""What a dropped prefill leg costs a busy P: P's marginal time per leg, as a share of P's time per
prefilled prompt, with P's token budget at 512 and at 512 plus a small reserve (in one run).

`dropped_leg_cost.py` measures a leg on an idle P, where it runs in a step of its own. Here P is
kept busy, and the question is what the leg adds to P's work.

**Setup.** An adaptive deployment with a remote-overhead estimate so high that D prefills every
prompt itself, so every leg the router sends P is dropped (cut to one prompt token). P is kept
busy by `--concurrency` closed-loop clients that send 512-token prompts (max_tokens 1) straight
to P's own API: plain requests, which P prefills.

**Blocks.** Each pair has two blocks of `--block-s` seconds, in random order:
- A: direct prompts only;
- B: direct prompts plus `--routed` closed-loop clients sending requests through the router, each
  of which drops one leg on P.

**Estimate.** With `a` = P's time per direct prompt in A (block time / prompts finished), a B
block of T seconds that finished `n` prompts and `L` dropped legs gives a marginal cost per leg of
`c = (T - (n + R) * a) / L`. R counts the legs D still sent to P (remote decisions, counted by D),
each charged a whole prefill. The ratio `c / a` per pair gives a mean with a t interval over the
pairs (scipy.stats).

Everything else on the machine (router, this client) is placed by the OS on either core, P's
included, so its share of the B traffic is charged to the leg: the figure is an upper bound of P's
own cost. `--others-core C` pins the router and this script's threads to core C (D's core, 1, on a
2-core machine), so P's core runs P alone and the figure is P's own marginal cost.

`--mode read` measures adaptive placement in READ mode, where P decides and a leg it leaves to D
jumps its queue (read_placement.py); its budget as shipped is 528 (a 512-token chunk plus 16).

    .venv/bin/python scripts/dropped_leg_marginal.py --model small --pairs 6 --out benchmarks/adaptive/dropped-leg-marginal.json
    .venv/bin/python scripts/dropped_leg_marginal.py --mode read --budgets 528 --model small --pairs 6 \
        --out benchmarks/adaptive/dropped-leg-marginal-read.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import threading
import time
from pathlib import Path

import requests
from scipy import stats

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pdserve.bench.placements import read_counts  # noqa: E402
from pdserve.launch import Cluster, UpOptions  # noqa: E402
from pdserve.launch.pd_modes import pd_deployment  # noqa: E402
from pdserve.model.build import resolve_model  # noqa: E402

ALL_LOCAL = {"placement": "adaptive", "transfer_overhead_ms": 1e5, "itl_target_ms": 1e5, "max_step_ms": 1e5}


def decisions(decode_url: str) -> dict[str, int]:
    """D's placement decisions so far: {"local": n, "remote": m}."""
    counts = read_counts([decode_url], timeout_s=30)
    if counts is None:
        raise RuntimeError(f"cannot read {decode_url}/metrics")
    return {where: sum(n for label, n in counts.items() if label.startswith(where + ":")) for where in ("local", "remote")}


class Prompts:
    """Distinct random prompts (no prefix-cache hits), from one seeded stream, thread-safe."""

    def __init__(self, isl: int, seed: int) -> None:
        self._rng, self._isl, self._lock = random.Random(seed), isl, threading.Lock()

    def next(self) -> list[int]:
        with self._lock:
            return [self._rng.randrange(10, 4000) for _ in range(self._isl)]


def closed_loop(url: str, model: str, prompts: Prompts, stop_at: float, done: list[tuple[float, float]]) -> None:
    """Send one prompt at a time until stop_at; record (finish time, latency) of each that succeeded."""
    while time.monotonic() < stop_at:
        sent = time.monotonic()
        r = requests.post(f"{url}/v1/completions", timeout=600,
                          json={"model": model, "prompt": prompts.next(), "max_tokens": 1, "temperature": 0})
        r.raise_for_status()
        done.append((time.monotonic(), time.monotonic() - sent))


def block(cluster: Cluster, model: str, prompts: Prompts, with_legs: bool, seconds: float, concurrency: int,
          routed_concurrency: int) -> dict:
    p_url, d_url = cluster.instance_urls["prefill"], cluster.instance_urls["decode"]
    before = decisions(d_url)
    start = time.monotonic()
    stop_at = start + seconds
    direct: list[tuple[float, float]] = []
    routed: list[tuple[float, float]] = []
    threads = [threading.Thread(target=closed_loop, args=(p_url, model, prompts, stop_at, direct))
               for _ in range(concurrency)]
    if with_legs:
        threads += [threading.Thread(target=closed_loop, args=(cluster.endpoint, model, prompts, stop_at, routed))
                    for _ in range(routed_concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=seconds + 600)
    return {"with_legs": with_legs, "seconds": seconds,
            "direct_done": sum(1 for t, _ in direct if t <= stop_at),
            "direct_latency_s": statistics.fmean(lat for _, lat in direct) if direct else None,
            "routed_latency_s": statistics.fmean(lat for _, lat in routed) if routed else None,
            **{where: n - before[where] for where, n in decisions(d_url).items()}}


def pin_others(cluster: Cluster, core: int) -> None:
    """The router (and whatever else is not a vLLM instance) and this process on `core` only."""
    import psutil

    instances = {spec.name for spec in cluster.deployment.instances}
    for process in cluster.processes:
        if process.name not in instances and process.pid is not None:
            for proc in [psutil.Process(process.pid), *psutil.Process(process.pid).children(recursive=True)]:
                proc.cpu_affinity([core])
    os.sched_setaffinity(0, {core})


def measure(budget: int, args: argparse.Namespace, port: int) -> dict:
    extra_args = ("--long-prefill-token-threshold", str(args.isl)) if budget > args.isl else ()
    options = UpOptions(mode=args.mode, model=str(resolve_model(args.model)), port=port, prefill_budget=budget,
                        decode_budget=64, prefix_caching=False, enforce_eager=True, extra_vllm_args=extra_args)
    cluster = Cluster(pd_deployment(options, args.mode, ALL_LOCAL))
    cluster.start()
    try:
        cluster.wait_healthy(900)
        if args.others_core is not None:
            pin_others(cluster, args.others_core)
        model = requests.get(f"{cluster.instance_urls['prefill']}/v1/models", timeout=30).json()["data"][0]["id"]
        prompts = Prompts(args.isl, seed=budget)
        # warm both streams together: D places a prompt locally only once it has cost estimates and
        # while P has a queue (an idle P gets every prompt: remote:prefill_idle)
        for _ in range(6):
            if block(cluster, model, prompts, True, 10, args.concurrency, args.routed)["local"] >= 3:
                break
        else:
            reasons = [line for line in requests.get(f"{cluster.instance_urls['decode']}/metrics", timeout=30).text
                       .splitlines() if line.startswith("pdserve:placements_total{")]
            raise RuntimeError("decode never prefilled a prompt itself during warm-up: " + "; ".join(reasons))
        print(f"P budget {budget}: warmed up", flush=True)
        order = random.Random(args.seed + budget)
        pairs = []
        for _ in range(args.pairs):
            flags = [False, True]
            order.shuffle(flags)
            blocks = {b["with_legs"]: b for b in (block(cluster, model, prompts, f, args.block_s, args.concurrency, args.routed)
                                                   for f in flags)}
            a, b = blocks[False], blocks[True]
            per_prompt = a["seconds"] / a["direct_done"]
            per_leg = (b["seconds"] - (b["direct_done"] + b["remote"]) * per_prompt) / b["local"]
            pairs.append({"without": a, "with": b, "p_s_per_prompt": per_prompt, "p_s_per_leg": per_leg,
                          "ratio": per_leg / per_prompt})
            print(f"  pair {len(pairs)}: {json.dumps(pairs[-1])}", flush=True)
    finally:
        cluster.stop()
    ratios = [p["ratio"] for p in pairs]
    mean = statistics.fmean(ratios)
    half = stats.t.ppf(0.975, len(ratios) - 1) * statistics.stdev(ratios) / len(ratios) ** 0.5
    return {"prefill_budget": budget, "pairs": pairs, "ratio_mean": mean, "ratio_ci95": [mean - half, mean + half],
            "p_ms_per_prompt": 1000 * statistics.fmean(p["p_s_per_prompt"] for p in pairs),
            "p_ms_per_leg": 1000 * statistics.fmean(p["p_s_per_leg"] for p in pairs)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="small")
    ap.add_argument("--mode", choices=("write", "read"), default="write", help="the transfer mode of the adaptive deployment")
    ap.add_argument("--isl", type=int, default=512)
    ap.add_argument("--budgets", default="512,520", help="P's --max-num-batched-tokens, one deployment each; "
                    "above --isl, P's --long-prefill-token-threshold is --isl (the rest is a reserve legs fit in)")
    ap.add_argument("--pairs", type=int, default=6)
    ap.add_argument("--block-s", type=float, default=30.0)
    ap.add_argument("--concurrency", type=int, default=3, help="closed-loop clients sending prompts straight to P")
    ap.add_argument("--routed", type=int, default=4, help="closed-loop clients sending prompts through the router")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--port", type=int, default=32400)
    ap.add_argument("--others-core", type=int, default=None,
                    help="pin the router and this script to this core (D's), so P's core runs P alone")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    cpu = Path("/proc/cpuinfo").read_text().split("model name")[1].split(":")[1].splitlines()[0].strip()
    rows = [measure(int(b), args, args.port + 20 * i) for i, b in enumerate(args.budgets.split(","))]
    others = "unpinned" if args.others_core is None else f"on core {args.others_core}"
    print(f"{args.mode} mode, model {args.model}, ISL {args.isl}, {args.pairs} pairs of {args.block_s:g} s blocks, "
          f"{args.concurrency} direct clients, router and clients {others}, CPU: {cpu}")
    for row in rows:
        lo, hi = row["ratio_ci95"]
        legs = sum(p["with"]["local"] for p in row["pairs"])
        remote = sum(p["with"]["remote"] for p in row["pairs"])
        print(f"  P budget {row['prefill_budget']:>4}: P per prompt {row['p_ms_per_prompt']:7.1f} ms, "
              f"marginal per dropped leg {row['p_ms_per_leg']:6.1f} ms = {100 * row['ratio_mean']:5.2f}% "
              f"[{100 * lo:.2f}, {100 * hi:.2f}] of a prompt ({legs:.0f} legs dropped, {remote:.0f} sent to P)")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"cpu": cpu, "rows": rows, "args": vars(args)}, default=str, indent=2) + "\n")


if __name__ == "__main__":
    main()
