#!/usr/bin/env python
"""What a prefill leg costs P when decode prefills the prompt itself (adaptive placement), against
what P spends prefilling the same prompt (static WRITE), on the same prompts, in one run.

P's cost is the engine time P spends on the leg: vLLM's own `vllm:request_prefill_time_seconds`
on P (from the leg's first scheduling to its first token: the forward passes that computed its
prompt), averaged over the legs. The CPU time of P's processes is printed too, but it is not a
cost measure: vLLM's CPU executor busy-polls whenever any request is live, so it tracks how long
legs exist, not what they compute.
Adaptive runs with a remote-overhead estimate so high that decode prefills every prompt itself
once warmed up (warm-up requests are not measured); the counters confirm every measured leg was
placed local. Prints a table and writes JSON with --out.

    .venv/bin/python scripts/dropped_leg_cost.py --model small --requests 30 --isl 512
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import sys
import time
from pathlib import Path

import requests

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pdserve.launch import Cluster, UpOptions  # noqa: E402
from pdserve.launch.pd_modes import pd_deployment  # noqa: E402
from pdserve.launch.process import group_members  # noqa: E402
from pdserve.model.build import resolve_model  # noqa: E402

TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pgid: int) -> float:
    total = 0
    for pid in group_members(pgid):
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])  # utime, stime
        except (OSError, IndexError, ValueError):
            pass
    return total / TICKS


def metric(url: str, name: str, **labels) -> float:
    total = 0.0
    for line in requests.get(f"{url}/metrics", timeout=30).text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def send(endpoint: str, model: str, prompt: list[int], max_tokens: int) -> None:
    r = requests.post(f"{endpoint}/v1/completions", timeout=600,
                      json={"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
    r.raise_for_status()


def measure(label: str, options: UpOptions, extra: dict, prompts: list[list[int]], warmup: list[list[int]],
            max_tokens: int, idle_s: float) -> dict:
    cluster = Cluster(pd_deployment(options, "write", extra))
    cluster.start()
    try:
        cluster.wait_healthy(900)
        p_url, d_url = cluster.instance_urls["prefill"], cluster.instance_urls["decode"]
        model = requests.get(f"{p_url}/v1/models", timeout=30).json()["data"][0]["id"]
        deadline = time.monotonic() + 120
        while True:
            try:
                send(cluster.endpoint, model, [11, 12, 13], 1)
                break
            except requests.RequestException:
                if time.monotonic() > deadline:
                    raise
                time.sleep(1)
        for prompt in warmup:
            send(cluster.endpoint, model, prompt, max_tokens)
        pgid = cluster.instances[0].pid
        time.sleep(2)
        idle_start, t0 = cpu_seconds(pgid), time.monotonic()
        time.sleep(idle_s)
        idle_rate = (cpu_seconds(pgid) - idle_start) / (time.monotonic() - t0)
        local0 = metric(d_url, "pdserve:placements_total", placement="local")
        prefill0 = (metric(p_url, "vllm:request_prefill_time_seconds_sum"),
                    metric(p_url, "vllm:request_prefill_time_seconds_count"))
        cpu0, t0 = cpu_seconds(pgid), time.monotonic()
        for prompt in prompts:  # one at a time: P's work per leg, not a queue
            send(cluster.endpoint, model, prompt, max_tokens)
        wall = time.monotonic() - t0
        cpu = cpu_seconds(pgid) - cpu0
        local = metric(d_url, "pdserve:placements_total", placement="local") - local0
        prefill_s = metric(p_url, "vllm:request_prefill_time_seconds_sum") - prefill0[0]
        legs = metric(p_url, "vllm:request_prefill_time_seconds_count") - prefill0[1]
    finally:
        cluster.stop()
    net = max(0.0, cpu - idle_rate * wall)
    return {"config": label, "requests": len(prompts), "local_placements": local, "wall_s": round(wall, 2),
            "p_cpu_s": round(cpu, 3), "p_idle_cpu_per_s": round(idle_rate, 4),
            "p_net_cpu_s_per_leg": round(net / len(prompts), 5), "p_legs": legs,
            "p_prefill_s_per_leg": round(prefill_s / legs, 5) if legs else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="small")
    ap.add_argument("--requests", type=int, default=30)
    ap.add_argument("--isl", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--port", type=int, default=32200)
    ap.add_argument("--idle-s", type=float, default=5.0)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    rng = random.Random(7)
    make = lambda n: [[rng.randrange(10, 4000) for _ in range(args.isl)] for _ in range(n)]
    warmup, prompts = make(12), make(args.requests)
    options = UpOptions(mode="write", model=str(resolve_model(args.model)), port=args.port, prefill_budget=512,
                        decode_budget=64, prefix_caching=False, enforce_eager=True)
    rows = [
        measure("static write (P prefills)", options, {}, prompts, warmup, args.max_tokens, args.idle_s),
        measure("adaptive, all local (P drops)", dataclasses.replace(options, port=args.port + 20),
                {"placement": "adaptive", "transfer_overhead_ms": 1e5, "itl_target_ms": 1e5, "max_step_ms": 1e5},
                prompts, warmup, args.max_tokens, args.idle_s),
    ]
    ratio = rows[1]["p_prefill_s_per_leg"] / rows[0]["p_prefill_s_per_leg"]
    print(f"model {args.model}, ISL {args.isl}, {args.requests} sequential requests, CPU: "
          f"{Path('/proc/cpuinfo').read_text().split('model name')[1].split(':')[1].splitlines()[0].strip()}")
    for row in rows:
        print(f"  {row['config']:<32} P engine time per leg {1000 * row['p_prefill_s_per_leg']:8.1f} ms   "
              f"(P CPU per leg {1000 * row['p_net_cpu_s_per_leg']:6.0f} ms, busy-polling included)   "
              f"local placements {row['local_placements']:.0f}/{row['requests']}   wall {row['wall_s']} s")
    print(f"  a leg decode prefills itself costs P {100 * ratio:.2f}% of prefilling the prompt")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"rows": rows, "dropped_over_prefilled": ratio, "args": vars(args)},
                                       default=str, indent=2) + "\n")


if __name__ == "__main__":
    main()
