"""SLO attainment of one run, and why the misses missed."""

from __future__ import annotations

import enum
from collections import Counter
from dataclasses import dataclass
from typing import Sequence

from pdserve.bench.records import RequestRecord
from pdserve.slo import SLO


class Verdict(enum.Enum):
    """A request's outcome against one SLO."""

    MET = "met"
    FAILED = "failed"  # error or no output: always a miss
    TTFT = "ttft"  # only the TTFT condition broke
    ITL = "itl"  # only an ITL condition (mean ITL or max gap) broke
    BOTH = "ttft+itl"


def judge(record: RequestRecord, slo: SLO) -> Verdict:
    if record.failed:
        return Verdict.FAILED
    broken = [c.metric for c in slo.conditions if not record.value(c.metric) < c.limit_ms]
    if not broken:
        return Verdict.MET
    ttft_broke = any(not m.is_itl for m in broken)
    itl_broke = any(m.is_itl for m in broken)
    if ttft_broke and itl_broke:
        return Verdict.BOTH
    return Verdict.TTFT if ttft_broke else Verdict.ITL


@dataclass(frozen=True)
class Attainment:
    """Counts of one run against one SLO; ``fraction`` counts failed requests as misses."""

    num_requests: int
    num_met: int
    misses: dict[Verdict, int]

    @property
    def fraction(self) -> float:
        return self.num_met / self.num_requests if self.num_requests else 0.0

    @property
    def main_miss_cause(self) -> Verdict | None:
        """The most frequent kind of miss (ties: failed, then TTFT, then ITL); None if no miss."""
        order = [Verdict.FAILED, Verdict.TTFT, Verdict.ITL, Verdict.BOTH]
        counts = [(self.misses.get(v, 0), -i, v) for i, v in enumerate(order)]
        count, _, verdict = max(counts)
        return verdict if count else None


def attainment(records: Sequence[RequestRecord], slo: SLO) -> Attainment:
    verdicts = Counter(judge(r, slo) for r in records)
    met = verdicts.pop(Verdict.MET, 0)
    return Attainment(num_requests=len(records), num_met=met, misses=dict(verdicts))
