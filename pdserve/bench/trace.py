"""The request stream of one point, written as a `vllm bench serve` timed trace.

pdserve draws the arrival times (``arrivals``) and the prompts itself and hands them to
`vllm bench serve --dataset-name timed_trace`, which replays them: the same stream reaches every
configuration, and at every rate the same prompts arrive in the same pattern.

Each entry names its prompt as a list of hash ids; the client expands every id into
``CHUNK_TOKENS`` token ids drawn from the vocabulary with a seed derived from the id (stable only
under a fixed PYTHONHASHSEED, which ``loadgen`` sets). Distinct ids give distinct prompts; a
shared-prefix workload gives every request of a group the same leading ids.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from pdserve.bench.arrivals import arrival_times
from pdserve.bench.plan import PROMPT_CHUNK_TOKENS as CHUNK_TOKENS  # --timed-trace-chunk-hash-size
from pdserve.bench.plan import Workload


def trace_rows(workload: Workload, seed: int, rate: float) -> list[dict]:
    """One row per request, in arrival order: timestamp (s), lengths, hash ids."""
    times = arrival_times(seed, workload.num_prompts, rate, workload.burstiness)
    num_chunks = math.ceil(workload.input_len / CHUNK_TOKENS)
    # prefix caching is on for shared-prefix runs: a fresh namespace per rate keeps one point's
    # prompts out of the next point's cache (the sharing pattern itself is the same at every rate)
    space = f"s{seed}" + (f"@{rate:g}" if workload.kind == "shared-prefix" else "")
    groups = _groups(workload, seed)
    rows = []
    for i, t in enumerate(times):
        ids = [f"{space}-r{i}-c{j}" for j in range(num_chunks)]
        if groups is not None:
            num_shared = workload.prefix_len // CHUNK_TOKENS
            ids[:num_shared] = [f"{space}-p{groups[i]}-c{j}" for j in range(num_shared)]
        rows.append({"timestamp": round(float(t), 6), "input_length": workload.input_len,
                     "output_length": workload.output_len, "hash_ids": ids})
    return rows


def write_trace(path: Path, workload: Workload, seed: int, rate: float) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in trace_rows(workload, seed, rate)))
    return path


def _groups(workload: Workload, seed: int) -> np.ndarray | None:
    if workload.kind != "shared-prefix":
        return None
    rng = np.random.default_rng([seed, 0x50524658])
    return rng.integers(workload.num_prefixes, size=workload.num_prompts)
