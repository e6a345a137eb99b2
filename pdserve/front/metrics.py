"""The front's own Prometheus series, answered at its GET /metrics where it fronts a PD deployment.

    metrics.count(RETRIED, reason="connect")      # a counter, by its labels
    metrics.set(INSTANCE_UP, 0, instance="decode")  # a gauge
    metrics.render()                               # the text exposition format, version 0.0.4

A name seen first through count() is a counter, through set() a gauge; any part of the front may
add a series by counting it.
"""

from __future__ import annotations

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

RETRIED = "pdserve:requests_retried_total"  # resent once to a live instance; label reason
CONTINUED = "pdserve:requests_continued_total"  # a stream broken off after tokens, continued on a live instance
ROUTED_AROUND = "pdserve:requests_routed_around_total"  # sent to an instance directly while one was down
FAILED_NO_INSTANCE = "pdserve:requests_failed_no_instance_total"  # answered 503: no live instance could serve it
INSTANCE_UP = "pdserve:instance_up"  # 1 while an instance answers its health probe; label instance

Labels = tuple[tuple[str, str], ...]


class FrontMetrics:
    """Counters and gauges by name and labels, kept in memory for the life of the process."""

    def __init__(self, counters: tuple[str, ...] = (ROUTED_AROUND, FAILED_NO_INSTANCE, CONTINUED)) -> None:
        self._kinds: dict[str, str] = {name: "counter" for name in counters}
        self._values: dict[tuple[str, Labels], float] = {(name, ()): 0.0 for name in counters}

    def count(self, name: str, **labels: str) -> None:
        """Add one to the counter `name` with `labels`."""
        self._kinds.setdefault(name, "counter")
        key = (name, tuple(sorted(labels.items())))
        self._values[key] = self._values.get(key, 0.0) + 1

    def set(self, name: str, value: float, **labels: str) -> None:
        """Set the gauge `name` with `labels` to `value`."""
        self._kinds.setdefault(name, "gauge")
        self._values[(name, tuple(sorted(labels.items())))] = float(value)

    def render(self) -> str:
        lines = []
        for name, kind in sorted(self._kinds.items()):
            lines.append(f"# TYPE {name} {kind}")
            for (each, labels), value in sorted(self._values.items()):
                if each == name:
                    lines.append(f"{name}{_labels(labels)} {_number(value)}")
        return "\n".join(lines) + "\n"


def _labels(labels: Labels) -> str:
    if not labels:
        return ""
    return "{" + ",".join(f'{key}="{_escaped(value)}"' for key, value in labels) + "}"


def _escaped(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _number(value: float) -> str:
    return str(int(value)) if value.is_integer() else repr(value)
