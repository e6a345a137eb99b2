"""The same tuning procedure for every configuration: its token budgets (budget.py).

Each candidate of a configuration is deployed and sent one point: the tuning stream (seed
``TUNE_SEED``, prompts distinct from every measured point, the same stream for every candidate
and every configuration) at the plan's headline rate. The objective, scored on the steady window
like every measured point: the highest attainment of the tuning SLO (the plan's ``tune_slo``,
else its first); ties go to the higher mean attainment over all the plan's SLOs, then to the
lower p90 TTFT. Trials and choices are kept in tune.json, so a resumed run does not tune again.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass
from typing import Sequence

from pdserve.bench.attainment import attainment
from pdserve.bench.budget import Budget
from pdserve.bench.plan import BenchPlan
from pdserve.bench.records import BenchRun
from pdserve.bench.stats import percentile
from pdserve.bench.summary import scored
from pdserve.errors import ConfigError

TUNE_SEED = 900_000  # one stream for every candidate; never a measured point's seed
OBJECTIVE = ("highest steady-window attainment of the tuning SLO at the tuning rate (ties: higher mean "
             "attainment over all SLOs, then lower p90 TTFT)")


@dataclass(frozen=True)
class Trial:
    budget: str  # Budget spec
    attainment: float  # of the tuning SLO
    mean_attainment: float  # over all SLOs
    ttft_p90_ms: float
    max_gap_p90_ms: float
    num_scored: int


def trial(plan: BenchPlan, budget: Budget, run: BenchRun) -> Trial:
    records = scored(plan, TUNE_SEED, run.records)
    ok = [r for r in records if not r.failed]
    return Trial(
        budget=str(budget),
        attainment=attainment(records, plan.tuning_slo).fraction,
        mean_attainment=statistics.fmean(attainment(records, slo).fraction for slo in plan.slos),
        ttft_p90_ms=percentile([r.ttft_ms for r in ok], 90),
        max_gap_p90_ms=percentile([r.max_gap_ms for r in ok], 90),
        num_scored=len(records),
    )


def choose(trials: Sequence[Trial]) -> Trial:
    def key(t: Trial):
        ttft = t.ttft_p90_ms if t.ttft_p90_ms == t.ttft_p90_ms else float("inf")  # NaN: nothing succeeded
        return (t.attainment, t.mean_attainment, -ttft)

    return max(trials, key=key)


@dataclass(frozen=True)
class TuneLog:
    """tune.json: the objective, the tuning point, and per configuration its trials and choice."""

    rate: float
    slo: str
    configs: dict[str, dict]  # config -> {"trials": [Trial as dict], "chosen": spec}

    def chosen(self, config: str) -> Budget | None:
        entry = self.configs.get(config)
        return Budget.parse(entry["chosen"]) if entry else None

    def with_config(self, config: str, trials: Sequence[Trial], chosen: Trial) -> "TuneLog":
        entry = {"trials": [asdict(t) for t in trials], "chosen": chosen.budget}
        return TuneLog(self.rate, self.slo, {**self.configs, config: entry})

    def to_json(self) -> str:
        return json.dumps({"objective": OBJECTIVE, "seed": TUNE_SEED, "rate": self.rate, "slo": self.slo,
                           "configs": self.configs}, indent=2) + "\n"

    @classmethod
    def from_json(cls, text: str) -> "TuneLog":
        try:
            data = json.loads(text)
            return cls(float(data["rate"]), str(data["slo"]), dict(data["configs"]))
        except (ValueError, TypeError, KeyError) as exc:
            raise ConfigError(f"tune.json is not a tuning log of this version: {exc!r}") from exc

    def describe(self, config: str) -> str | None:
        entry = self.configs.get(config)
        if entry is None:
            return None
        trials = ", ".join(f"{t['budget']}: {t['attainment']:.2f}" for t in entry["trials"])
        return f"{config}: budget {entry['chosen']} (tried {trials})"
