"""SLOTargets: what adaptive placement protects, read from the SLO the deployment declares.

Aggregated and disaggregated serving win under opposite SLOs (TaiChi, arXiv 2508.01989): a tight
TTFT with a loose per-token bound favours prefilling wherever a core is free, a bound on the
largest gap between tokens favours keeping prompts off the decode instance. One placement rule
cannot serve both, so the user says which SLO the deployment serves (`slo` in
kv_connector_extra_config, `pdserve up --slo`, the bench's syntax: ``ttft<500,mean_itl<40``) and
D's bounds follow it:

* ``mean_itl<X``: the ITL guard keeps D's streams' mean ITL under X;
* ``max_gap<Y``: no step of D's streams (a local chunk's, or P's with serve_decode) takes longer
  than Y; without a max_gap bound, steps are not bounded: D prefills a prompt whole while it
  decodes, as plain serving does, as long as the mean ITL holds;
* a max_gap bound alone bounds the mean ITL too (a mean is never above the largest gap);
* ``ttft<Z``: while P's estimated TTFT is within TTFT_HEADROOM x Z, the prompt goes to P even where
  D would be faster, so D's streams keep their ITL budget for the prompts P cannot serve in time
  (without it, placement takes the faster side).

Free of vLLM.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pdserve.slo import SLO, Metric


@dataclass(frozen=True)
class SLOTargets:
    itl_target_ms: float  # D's streams' mean ITL bound (inf: none)
    max_step_ms: float  # the longest step D's streams may see (inf: none)
    ttft_target_ms: float  # the TTFT bound (inf: none)

    @classmethod
    def of(cls, slo: SLO) -> "SLOTargets":
        gap = slo.limit(Metric.MAX_GAP)
        mean = slo.limit(Metric.MEAN_ITL)
        if mean is None:
            mean = gap
        ttft = slo.limit(Metric.TTFT)
        return cls(math.inf if mean is None else mean, math.inf if gap is None else gap,
                   math.inf if ttft is None else ttft)


__all__ = ["SLOTargets"]
