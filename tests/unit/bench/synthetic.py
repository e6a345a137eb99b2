"""Synthetic vllm-bench result files for the bench tests."""

from __future__ import annotations

import json
from pathlib import Path

from pdserve.bench.plan import BenchPlan, Workload
from pdserve.slo import SLO


def plan(**over) -> BenchPlan:
    fields = dict(
        configs=("collocated", "round-robin"),
        rates=(1.0, 2.0, 3.0),
        seeds=(1, 2),
        workload=Workload(input_len=64, output_len=4, num_prompts=10),
        slos=(SLO.parse("blog:ttft<1000,mean_itl<50"), SLO.parse("stall:ttft<1000,max_gap<100")),
        model="tiny",
        headline_rate=2.0,
        warmup_fraction=0.0,  # score every request unless a test asks for a window
        cooldown_fraction=0.0,
    )
    fields.update(over)
    return BenchPlan(**fields)


def bench_json(ttfts_ms, itls_ms, failed=()) -> dict:
    """A --save-detailed style result; requests listed in ``failed`` have an error and no output."""
    n = len(ttfts_ms)
    return {
        "duration": 10.0, "request_throughput": n / 10.0, "output_throughput": 4 * n / 10.0,
        "ttfts": [0.0 if i in failed else t / 1000 for i, t in enumerate(ttfts_ms)],
        "itls": [[] if i in failed else [g / 1000 for g in itls_ms[i]] for i in range(n)],
        "errors": ["boom" if i in failed else "" for i in range(n)],
        "output_lens": [0 if i in failed else len(itls_ms[i]) + 1 for i in range(n)],
        "input_lens": [64] * n,
    }


def write(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))


def met(n):
    return [100.0] * n, [[20.0, 20.0, 20.0]] * n


def slow_ttft(n):
    return [1500.0] * n, [[20.0, 20.0, 20.0]] * n


def stalled(n):
    """Meets the blog SLO (mean 40 ms) but not the stall SLO (one 150 ms gap)."""
    return [100.0] * n, [[10.0, 10.0, 150.0, 10.0, 20.0]] * n


def point_data(met_n: int, ttft_n: int, itl_n: int = 0, failed_n: int = 0, stalled_n: int = 0) -> dict:
    t, i = [], []
    for make, k in ((met, met_n), (slow_ttft, ttft_n), (stalled, stalled_n)):
        a, b = make(k)
        t += a
        i += b
    t += [100.0] * itl_n
    i += [[90.0, 90.0]] * itl_n
    t += [0.0] * failed_n
    i += [[]] * failed_n
    failed = set(range(len(t) - failed_n, len(t)))
    return bench_json(t, i, failed)
