"""Service-level objectives: a named conjunction of per-request latency limits.

An SLO is written on the command line as ``name:ttft<1000,mean_itl<50`` (milliseconds; the
``name:`` prefix is optional). A request meets it when every condition holds strictly. The bench
scores requests against SLOs; adaptive placement can be told the SLO it serves
(placement/slo_targets.py), in the same syntax.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass

from pdserve.errors import ConfigError


class Metric(enum.Enum):
    """Per-request latency statistics an SLO condition can bound (all in ms)."""

    TTFT = "ttft"
    MEAN_ITL = "mean_itl"  # mean of the request's inter-chunk gaps
    MAX_GAP = "max_gap"  # largest inter-chunk gap of the request

    @property
    def is_itl(self) -> bool:
        return self is not Metric.TTFT


@dataclass(frozen=True)
class Condition:
    metric: Metric
    limit_ms: float

    def __str__(self) -> str:
        return f"{self.metric.value}<{self.limit_ms:g}"


@dataclass(frozen=True)
class SLO:
    """A named set of conditions; ``str(slo)`` round-trips through ``SLO.parse``."""

    name: str
    conditions: tuple[Condition, ...]

    @classmethod
    def parse(cls, text: str) -> "SLO":
        name, sep, body = text.strip().rpartition(":")
        if not sep:
            body = text.strip()
        conditions = tuple(_parse_condition(part) for part in body.split(",") if part.strip())
        if not conditions:
            raise ConfigError(f"SLO {text!r} has no conditions")
        metrics = [c.metric for c in conditions]
        if len(set(metrics)) != len(metrics):
            raise ConfigError(f"SLO {text!r} bounds a metric twice")
        return cls(name=name.strip() or body.strip(), conditions=conditions)

    def limit(self, metric: Metric) -> float | None:
        return next((c.limit_ms for c in self.conditions if c.metric is metric), None)

    @property
    def spec(self) -> str:
        return ",".join(str(c) for c in self.conditions)

    def __str__(self) -> str:
        return f"{self.name}:{self.spec}"


_CONDITION = re.compile(r"^\s*([a-z_]+)\s*<\s*([0-9]+(?:\.[0-9]*)?)\s*(ms)?\s*$")


def _parse_condition(text: str) -> Condition:
    match = _CONDITION.match(text)
    if match is None:
        raise ConfigError(f"SLO condition {text!r} is not of the form metric<ms, e.g. ttft<1000")
    key, value = match.group(1), float(match.group(2))
    try:
        metric = Metric(key)
    except ValueError:
        known = ", ".join(m.value for m in Metric)
        raise ConfigError(f"unknown SLO metric {key!r} (known: {known})") from None
    if value <= 0:
        raise ConfigError(f"SLO limit must be positive: {text!r}")
    return Condition(metric, value)
