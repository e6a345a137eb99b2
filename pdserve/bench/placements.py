"""What adaptive placement decided at each point: the change of the instances'
`pdserve:placements_total{placement,reason}` counters over the point (read from each instance's
/metrics just before and just after it, so the deployment's warm-up is not counted).

    <dir>/placements/<config>/r<rate>_s<seed>.json   {"remote:prefill_idle": 31, "local:local_faster": 9, ...}

Beside the decisions, under `chunk_step:within` / `chunk_step:over`, the change of
`pdserve:local_chunk_steps_total{bound}`: decode's steps with a local chunk and, with serve_decode,
P's steps that prefilled beside streams of its own, by whether they kept the bound the chunk was
sized for.

Counters count every request of the point, not only the scored ones; plain serving has no
connector and no decisions, and no row in the report.
"""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Mapping, Sequence

from pdserve.bench.samples import parse_samples
from pdserve.placement.chunk_size import OVER

METRIC = "pdserve:placements_total"
CHUNK_METRIC = "pdserve:local_chunk_steps_total"  # decode's steps with a local chunk, by bound=within|over
CHUNK_PREFIX = "chunk_step:"  # its counts' labels: "chunk_step:within", "chunk_step:over"
_LABEL = re.compile(r'(\w+)="([^"]*)"')

Counts = dict[str, int]  # "placement:reason" -> decisions


def read_counts(instance_urls: Sequence[str], timeout_s: float = 10.0) -> Counter[str] | None:
    """The placement counters summed over ``instance_urls``; None when one cannot be read (the point
    is then measured without its decisions rather than lost)."""
    counts: Counter[str] = Counter()
    for url in instance_urls:
        try:
            with urllib.request.urlopen(f"{url}/metrics", timeout=timeout_s) as resp:
                text = resp.read().decode("utf-8", "replace")
        except (urllib.error.URLError, OSError):
            return None
        counts.update(counts_of(text))
    return counts


def counts_of(metrics_text: str) -> Counter[str]:
    """``placement:reason`` -> counter value, from one /metrics page."""
    counts: Counter[str] = Counter()
    for key, value in parse_samples(metrics_text).items():
        name, _, labels = key.partition("{")
        found = dict(_LABEL.findall(labels))
        if name == METRIC:
            counts[f"{found.get('placement', '?')}:{found.get('reason', '?')}"] += int(value)
        elif name == CHUNK_METRIC:
            counts[CHUNK_PREFIX + found.get("bound", "?")] += int(value)  # chunk_size.WITHIN / OVER
    return counts


def difference(before: Mapping[str, int], after: Mapping[str, int]) -> Counts:
    """Decisions taken between two readings (labels that did not move are left out)."""
    return {label: n for label in sorted(after) if (n := after[label] - before.get(label, 0)) > 0}


def save(path: Path, counts: Counts) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(counts, indent=1, sort_keys=True) + "\n")
    tmp.replace(path)


def load(path: Path) -> Counts:
    data = json.loads(path.read_text())
    return {str(k): int(v) for k, v in data.items()}


def section(rows: Sequence[tuple[str, float, Counts]]) -> list[str]:
    """The report's table: one row per (configuration, rate) with decisions, counts summed over seeds."""
    rows = [(c, r, counts) for c, r, counts in rows if sum(counts.values()) > 0]
    if not rows:
        return []
    lines = ["## Placement decisions", "",
             "Decode's `pdserve:placements_total` over each point (every request of the point, not only the "
             "scored ones), summed over seeds. Remote: prefilled on P; local: prefilled on D in chunks "
             "(static PD decides `remote:static` every time; requests P serves whole are not decode's "
             "to place). Chunk steps over bound: decode's steps with a chunk "
             "of local prefill that ran past the bound the chunk was sized for (`max_step_ms` with "
             "streams running, the response bound), and P's steps that prefilled beside requests it "
             "serves whole and ran past `max_step_ms` (counted from 2026-12-05), of all such steps.", "",
             "| configuration | rate | decided | remote | local | chunk steps over bound | reasons (most frequent first) |",
             "|---|---|---|---|---|---|---|"]
    for config, rate, counts in rows:
        over, steps = counts.get(CHUNK_PREFIX + OVER, 0), sum(n for k, n in counts.items() if k.startswith(CHUNK_PREFIX))
        counts = {label: n for label, n in counts.items() if not label.startswith(CHUNK_PREFIX)}
        total = sum(counts.values()) or 1
        by_placement = Counter()
        for label, n in counts.items():
            by_placement[label.partition(":")[0]] += n
        share = lambda p: f"{by_placement[p]} ({by_placement[p] / total:.0%})"  # noqa: E731, B023  used in this iteration
        reasons = ", ".join(f"{label} {n}" for label, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))
        chunk = f"{over} of {steps} ({over / steps:.0%})" if steps else "—"
        lines.append(f"| {config} | {rate:g} | {sum(counts.values())} | {share('remote')} | {share('local')} | {chunk} "
                     f"| {reasons} |")
    return lines + [""]
