"""Tuning the `chunked` configuration's --max-num-batched-tokens.

Each candidate budget runs round-robin at the headline rate with one arrival seed (prompts
distinct from every measured point). The chosen budget minimises the p90 of per-request max
inter-chunk gap among candidates that keep TTFT attainment (TTFT < the first SLO's TTFT limit)
at or above the plan's target; if none does, the best TTFT attainment wins. Results are kept in
tune.json so a resumed run does not tune again.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Sequence

from pdserve.bench.plan import BenchPlan
from pdserve.bench.records import BenchRun
from pdserve.bench.slo import Metric
from pdserve.bench.stats import percentile

TUNE_SEED = 900_000  # one stream for every candidate; never a measured point's seed


@dataclass(frozen=True)
class ChunkTrial:
    max_num_batched_tokens: int
    max_gap_p90_ms: float
    ttft_p90_ms: float
    ttft_attainment: float


def ttft_limit(plan: BenchPlan) -> float:
    limits = [lim for slo in plan.slos if (lim := slo.limit(Metric.TTFT)) is not None]
    return limits[0] if limits else float("inf")


def trial(plan: BenchPlan, budget: int, run: BenchRun) -> ChunkTrial:
    ok = [r for r in run.records if not r.failed]
    limit = ttft_limit(plan)
    within = sum(1 for r in ok if r.ttft_ms < limit)
    return ChunkTrial(
        max_num_batched_tokens=budget,
        max_gap_p90_ms=percentile([r.max_gap_ms for r in ok], 90),
        ttft_p90_ms=percentile([r.ttft_ms for r in ok], 90),
        ttft_attainment=within / len(run.records) if run.records else 0.0,
    )


def choose(plan: BenchPlan, trials: Sequence[ChunkTrial]) -> ChunkTrial:
    keeping = [t for t in trials if t.ttft_attainment >= plan.target]
    if keeping:
        return min(keeping, key=lambda t: (t.max_gap_p90_ms, t.max_num_batched_tokens))
    return max(trials, key=lambda t: (t.ttft_attainment, -t.max_gap_p90_ms))


def to_json(trials: Sequence[ChunkTrial], chosen: ChunkTrial) -> str:
    return json.dumps({"trials": [asdict(t) for t in trials], "chosen": chosen.max_num_batched_tokens}, indent=2)


def chosen_from_json(text: str) -> int:
    return int(json.loads(text)["chosen"])
