"""Per-request records, read once from a ``vllm bench serve --save-detailed`` result file.

The bench JSON keeps parallel lists (``ttfts``, ``itls``, ``errors``, ...), in seconds; this
module turns them into one typed record per request, in milliseconds. Nothing else in the bench
package reads the raw JSON.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path

from pdserve.errors import ConfigError
from pdserve.slo import Metric

_DETAIL_KEYS = ("ttfts", "itls", "errors", "output_lens", "input_lens")


@dataclass(frozen=True)
class RequestRecord:
    """One measured request. ``failed`` requests carry no meaningful latencies."""

    ttft_ms: float
    itl_ms: tuple[float, ...]  # gaps between consecutive content chunks
    failed: bool
    input_len: int = 0
    output_len: int = 0
    error: str = ""
    start_s: float = float("nan")  # when the client sent it (its clock; only differences mean anything)

    @property
    def mean_itl_ms(self) -> float:
        """Mean inter-chunk gap; 0 for a request with a single chunk (as vLLM treats TPOT)."""
        return statistics.fmean(self.itl_ms) if self.itl_ms else 0.0

    def short_of(self, requested_len: int) -> bool:
        """Finished without error yet produced fewer than ``requested_len`` tokens."""
        return not self.failed and self.output_len < requested_len

    @property
    def max_gap_ms(self) -> float:
        return max(self.itl_ms, default=0.0)

    def value(self, metric: Metric) -> float:
        if metric is Metric.TTFT:
            return self.ttft_ms
        if metric is Metric.MEAN_ITL:
            return self.mean_itl_ms
        return self.max_gap_ms


@dataclass(frozen=True)
class BenchRun:
    """One ``vllm bench serve`` invocation: its requests plus the aggregate numbers we report."""

    records: tuple[RequestRecord, ...]
    duration_s: float
    request_throughput: float
    output_throughput: float

    @property
    def num_failed(self) -> int:
        return sum(r.failed for r in self.records)

    def num_short(self, requested_len: int) -> int:
        """Requests that did not reach their requested output length (without failing)."""
        return sum(r.short_of(requested_len) for r in self.records)


def records_from_bench(data: dict) -> tuple[RequestRecord, ...]:
    """Build records from the parsed bench JSON; a request failed if it has an error or no output."""
    missing = [k for k in _DETAIL_KEYS if k not in data]
    if missing:
        raise ConfigError(f"bench result lacks {missing}: was it run with --save-detailed?")
    starts = data.get("start_times") or [None] * len(data["ttfts"])
    rows = zip(data["ttfts"], data["itls"], data["errors"], data["output_lens"], data["input_lens"], starts)
    records = []
    for ttft_s, itls_s, error, output_len, input_len, start_s in rows:
        failed = bool(error) or not output_len
        records.append(
            RequestRecord(
                ttft_ms=1000.0 * float(ttft_s or 0.0),
                itl_ms=tuple(1000.0 * float(x) for x in (itls_s or ())),
                failed=failed,
                input_len=int(input_len or 0),
                output_len=int(output_len or 0),
                error=(error or "")[-500:],
                start_s=float("nan") if start_s is None else float(start_s),
            )
        )
    return tuple(records)


def load_bench_run(path: Path) -> BenchRun:
    """Read one saved bench result; raises ConfigError when it is unreadable or not detailed."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read bench result {path}: {exc}") from exc
    return BenchRun(
        records=records_from_bench(data),
        duration_s=float(data.get("duration") or 0.0),
        request_throughput=float(data.get("request_throughput") or 0.0),
        output_throughput=float(data.get("output_throughput") or 0.0),
    )
