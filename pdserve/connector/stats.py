"""Transfer counters, carried from the worker to the API server's /metrics by vLLM's stats path."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
from vllm.v1.metrics.utils import create_metric_per_engine

_EMPTY = {"num_completed": 0, "num_failed": 0, "num_bytes": 0, "seconds": [], "copy_seconds": 0.0, "copy_bytes": 0,
          "num_rejected": 0, "num_fenced": 0, "num_refused": 0, "num_recomputed": 0}
_SUMMED = tuple(k for k, v in _EMPTY.items() if not isinstance(v, list))


@dataclass
class PDConnectorStats(KVConnectorStats):
    def __post_init__(self):
        if not self.data:
            self.reset()

    def reset(self):
        self.data = {k: (list(v) if isinstance(v, list) else v) for k, v in _EMPTY.items()}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for key in _SUMMED:
            self.data[key] += other.data.get(key, 0)
        self.data["seconds"] = self.data["seconds"] + list(other.data.get("seconds", []))
        return self

    def reduce(self) -> dict[str, int | float]:
        seconds = self.data["seconds"]
        return {
            "transfers_completed": self.data["num_completed"],
            "transfers_failed": self.data["num_failed"],
            "bytes": self.data["num_bytes"],
            "avg_transfer_ms": round(1000 * sum(seconds) / len(seconds), 3) if seconds else 0.0,
        }

    def is_empty(self) -> bool:
        return not (self.data["num_completed"] or self.data["num_failed"] or self.data["num_rejected"])


class PDPromMetrics(KVConnectorPromMetrics):
    """On each instance's /metrics: `pdserve:kv_transfers_completed_total`, `..._failed_total`,
    `pdserve:kv_transfer_bytes_total` (KV delivered by completed transfers),
    `pdserve:kv_transfer_seconds_total` (announce/hold to completion, summed over transfers),
    `pdserve:kv_copy_bytes_total` / `pdserve:kv_copy_seconds_total` (what this side's transport
    copied and how long the copies took: their ratio is the data-path bandwidth)."""

    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)

        def counter(name: str, doc: str):
            metric = self._counter_cls(name=name, documentation=doc, labelnames=labelnames)
            return create_metric_per_engine(metric, per_engine_labelvalues)

        self._completed = counter("pdserve:kv_transfers_completed", "KV transfers completed by pdserve.")
        self._failed = counter("pdserve:kv_transfers_failed", "KV transfers that failed or timed out.")
        self._bytes = counter("pdserve:kv_transfer_bytes", "Bytes of KV cache moved by pdserve.")
        self._seconds = counter("pdserve:kv_transfer_seconds", "Seconds spent in completed KV transfers.")
        self._copy_bytes = counter("pdserve:kv_copy_bytes", "Bytes this instance's transport copied.")
        self._copy_seconds = counter("pdserve:kv_copy_seconds", "Seconds this instance's transport spent copying.")
        self._rejected = counter("pdserve:control_messages_rejected",
                                 "Control-plane messages rejected (undecodable, unauthenticated, replayed, fenced).")
        self._fenced = counter("pdserve:kv_transfers_fenced",
                               "KV transfers failed because their peer incarnation restarted or died.")
        self._refused = counter("pdserve:kv_transfers_refused", "KV transfers refused: peer not in allowed_peers.")
        self._recomputed = counter("pdserve:kv_recomputed",
                                   "Requests whose KV did not arrive and that decode prefilled itself.")

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0):
        self._completed[engine_idx].inc(transfer_stats_data.get("num_completed", 0))
        self._failed[engine_idx].inc(transfer_stats_data.get("num_failed", 0))
        self._bytes[engine_idx].inc(transfer_stats_data.get("num_bytes", 0))
        self._seconds[engine_idx].inc(sum(transfer_stats_data.get("seconds", [])))
        self._copy_bytes[engine_idx].inc(transfer_stats_data.get("copy_bytes", 0))
        self._copy_seconds[engine_idx].inc(transfer_stats_data.get("copy_seconds", 0.0))
        self._rejected[engine_idx].inc(transfer_stats_data.get("num_rejected", 0))
        self._fenced[engine_idx].inc(transfer_stats_data.get("num_fenced", 0))
        self._refused[engine_idx].inc(transfer_stats_data.get("num_refused", 0))
        self._recomputed[engine_idx].inc(transfer_stats_data.get("num_recomputed", 0))
