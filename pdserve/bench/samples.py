"""Prometheus samples of an instance's /metrics, as the bench, its two-host harness and the tests read them."""

from __future__ import annotations


def parse_samples(text: str) -> dict[str, float]:
    """The sample lines of a /metrics page, keyed by `name{labels}` as written."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out


def metric(samples: dict[str, float], name: str, **labels: str) -> float:
    """Sum of the samples of `name` whose labels include `labels`."""
    total = 0.0
    for key, value in samples.items():
        base, _, rest = key.partition("{")
        if base == name and all(f'{k}="{v}"' in rest for k, v in labels.items()):
            total += value
    return total
