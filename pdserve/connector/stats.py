"""Transfer counters and histograms, carried from the worker to the API server's /metrics by vLLM's stats path.

`PDWorker.take_stats` hands vLLM a plain dict (it crosses a process boundary); vLLM wraps it in
`PDConnectorStats`, aggregates the dicts of several steps and workers, and feeds each one to
`PDPromMetrics.observe` in the API server.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
from vllm.v1.metrics.utils import create_metric_per_engine

from pdserve.placement import OVER, WITHIN
from pdserve.transfer.engine import TransferStats

# What take_stats sends: the engine's TransferStats fields plus what the worker counts itself.
_EMPTY = {**asdict(TransferStats()), "num_rejected": 0, "num_recomputed": 0, "handshake_seconds": [],
          "placements": [], "prefill_queued_tokens": [], "serving_decode": [], "chunk_steps": [],
          "remote_paths": []}
_EMPTY["peers_attached"] = []  # "shm" or "nixl" per peer incarnation attached (transport/nixl_auto.py)
_LISTS = tuple(k for k, v in _EMPTY.items() if isinstance(v, list))  # one entry per event: concatenated
_SUMMED = tuple(k for k in _EMPTY if k not in _LISTS)

CHUNK_STEP_BOUNDS = (WITHIN, OVER)

# Shared memory on one host moves a small prompt's KV in about a millisecond; a network transport
# under load can take tens of seconds, and the transfer timeout ends a transfer at 30 s by default.
DURATION_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
# 1 KiB (a few tokens of a tiny model) to 4 GiB (a long prompt of a large model), doubling.
SIZE_BUCKETS_BYTES = tuple(float(1024 * 2**i) for i in range(23))


@dataclass
class PDConnectorStats(KVConnectorStats):
    def __post_init__(self):
        if not self.data:
            self.reset()

    def reset(self):
        self.data = {k: (list(v) if isinstance(v, list) else v) for k, v in _EMPTY.items()}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for key in _SUMMED:
            self.data[key] = self.data.get(key, 0) + other.data.get(key, 0)
        for key in _LISTS:
            self.data[key] = list(self.data.get(key, [])) + list(other.data.get(key, []))
        return self

    def reduce(self) -> dict[str, int | float]:
        seconds = self.data["seconds"]
        return {
            "transfers_completed": self.data["num_completed"],
            "transfers_failed": self.data["num_failed"],
            "bytes": self.data["num_bytes"],
            "avg_transfer_ms": round(1000 * sum(seconds) / len(seconds), 3) if seconds else 0.0,
            "handshakes": len(self.data["handshake_seconds"]),
        }

    def is_empty(self) -> bool:
        return not any(self.data.get(key) for key in _EMPTY)


# (key in the stats dict, metric name, documentation); a list value counts its sum
COUNTERS = (
    ("num_completed", "pdserve:kv_transfers_completed", "KV transfers completed by pdserve."),
    ("num_failed", "pdserve:kv_transfers_failed", "KV transfers that failed or timed out."),
    ("num_bytes", "pdserve:kv_transfer_bytes", "Bytes of KV cache moved by pdserve."),
    ("seconds", "pdserve:kv_transfer_seconds", "Seconds spent in completed KV transfers."),
    ("copy_bytes", "pdserve:kv_copy_bytes", "Bytes this instance's transport copied."),
    ("copy_seconds", "pdserve:kv_copy_seconds", "Seconds this instance's transport spent copying."),
    ("num_rejected", "pdserve:control_messages_rejected",
     "Control-plane messages rejected (undecodable, unauthenticated, replayed, fenced)."),
    ("num_fenced", "pdserve:kv_transfers_fenced", "KV transfers failed because their peer incarnation restarted or died."),
    ("num_refused", "pdserve:kv_transfers_refused", "KV transfers refused: peer not in allowed_peers."),
    ("num_recomputed", "pdserve:kv_recomputed", "Requests whose KV did not arrive and that decode prefilled itself."),
    ("digest_seconds", "pdserve:kv_digest_seconds", "Seconds spent hashing KV blocks for kv_verify digest."),
)
DIGEST_MODES = ("write", "read")
# (key, name, documentation, buckets): one observation per list item
HISTOGRAMS = (
    ("seconds", "pdserve:kv_transfer_duration_seconds",
     "Seconds from announce (WRITE) or hold (READ) to completion, per completed KV transfer.", DURATION_BUCKETS_S),
    ("transfer_bytes", "pdserve:kv_transfer_size_bytes", "Bytes of KV delivered per completed transfer.",
     SIZE_BUCKETS_BYTES),
    ("handshake_seconds", "pdserve:kv_handshake_duration_seconds",
     "Seconds from handshake request to reply, per answered handshake.", DURATION_BUCKETS_S),
    ("remote_paths", "pdserve:remote_path_seconds",
     "Decode: per prompt it sent to a prefill instance, seconds from its placement decision to its first token "
     "beyond the prefill compute it estimated.", DURATION_BUCKETS_S),
)
# (key, name, documentation): the list's last value, as of the instance's last step
GAUGES = (
    ("prefill_queued_tokens", "pdserve:prefill_queued_tokens",
     "Prompt tokens this prefill instance accepted and has not computed."),
    ("serving_decode", "pdserve:serving_decode",
     "1 while this prefill instance also serves whole requests (registered as a decode instance: serve_decode)."),
)


class PDPromMetrics(KVConnectorPromMetrics):
    """On each instance's /metrics. Counters: `pdserve:kv_transfers_completed_total`, `..._failed_total`,
    `pdserve:kv_transfer_bytes_total` (KV delivered by completed transfers),
    `pdserve:kv_transfer_seconds_total` (announce/hold to completion, summed over transfers),
    `pdserve:kv_copy_bytes_total` / `pdserve:kv_copy_seconds_total` (what this side's transport
    copied and how long the copies took: their ratio is the data-path bandwidth), and the
    rejected/fenced/refused/recomputed counts. Histograms, one observation per completed transfer:
    `pdserve:kv_transfer_duration_seconds` (announce/hold to completion) and
    `pdserve:kv_transfer_size_bytes`; one per answered handshake this instance started:
    `pdserve:kv_handshake_duration_seconds`. With `kv_verify digest`,
    `pdserve:kv_digest_mismatch_total{transport,mode}` (D: transfers whose KV failed its digest,
    none served) and `pdserve:kv_digest_seconds_total` (time spent hashing). Placement (pdserve/placement/): on D,
    `pdserve:placements_total{placement=local|remote, reason=...}`, one per decision; on P,
    `pdserve:prefill_queued_tokens`, the prompt tokens it last published as queued, and, with
    `serve_decode`, `pdserve:placements_total{placement="whole",reason="serve_decode"}`, one per
    request it served whole (whole_requests.py), and `pdserve:serving_decode`, 1 while it offers
    itself to the router as a decode instance (placement/serve_gate.py; both gauges as of P's last
    step), and `pdserve:local_chunk_steps_total{bound=within|over}`, one per step that prefilled
    beside streams of its own, by whether it kept `max_step_ms` (placement/chunk_costs.py). On an
    adaptive D, `pdserve:local_chunk_steps_total{bound=within|over}`, one per step with a local
    chunk, by whether it kept the bound its chunk was sized for (`max_step_ms` with streams
    running, the response bound; placement/chunk_size.py), and `pdserve:remote_path_seconds`, one
    observation per prompt it sent to P with an estimate: seconds from the decision to its first
    token beyond the P compute the estimate assumed (placement/remote_path.py; its median is the
    path of D's next remote estimates)."""

    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)

        def counter(name: str, doc: str):
            metric = self._counter_cls(name=name, documentation=doc, labelnames=labelnames)
            return create_metric_per_engine(metric, per_engine_labelvalues)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]):
            metric = self._histogram_cls(name=name, documentation=doc, buckets=list(buckets), labelnames=labelnames)
            return create_metric_per_engine(metric, per_engine_labelvalues)

        self._counters = {key: counter(name, doc) for key, name, doc in COUNTERS}
        self._histograms = {key: histogram(name, doc, buckets) for key, name, doc, buckets in HISTOGRAMS}
        self._gauges = {key: create_metric_per_engine(
                            self._gauge_cls(name=name, documentation=doc, labelnames=labelnames,
                                            multiprocess_mode="mostrecent"), per_engine_labelvalues)
                        for key, name, doc in GAUGES}
        placement = self._counter_cls(name="pdserve:placements", labelnames=[*labelnames, "placement", "reason"],
                                      documentation="Placement decisions of decode: prefill remote (on P) or local.")
        self._placement_metric, self._labels = placement, per_engine_labelvalues
        self._placement_children: dict[tuple[int, str], Any] = {}
        chunk_steps = self._counter_cls(name="pdserve:local_chunk_steps", labelnames=[*labelnames, "bound"],
                                        documentation="Decode's steps with a chunk of local prefill, by whether "
                                                      "they kept the step bound the chunk was sized for.")
        self._chunk_steps = {idx: {b: chunk_steps.labels(*values, b) for b in CHUNK_STEP_BOUNDS}
                             for idx, values in per_engine_labelvalues.items()}
        self._peers_attached = _per_transport(self._counter_cls, labelnames, per_engine_labelvalues)
        self._mismatches = _digest_mismatches(self._counter_cls, labelnames, per_engine_labelvalues)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0):
        for key, metric in self._counters.items():
            value = transfer_stats_data.get(key, 0)
            metric[engine_idx].inc(sum(value) if isinstance(value, list) else value)
        for key, metric in self._histograms.items():
            for value in transfer_stats_data.get(key, []):
                metric[engine_idx].observe(value)
        for key, metric in self._gauges.items():
            values = transfer_stats_data.get(key, [])
            if values:
                metric[engine_idx].set(values[-1])
        for transport in transfer_stats_data.get("peers_attached", []):
            self._peers_attached[engine_idx][transport].inc()
        for label in transfer_stats_data.get("digest_mismatches", []):
            child = self._mismatches[engine_idx].get(label)
            if child is not None:
                child.inc()
        for label in transfer_stats_data.get("placements", []):
            self._placement_child(engine_idx, label).inc()
        for bound in transfer_stats_data.get("chunk_steps", []):
            if bound in CHUNK_STEP_BOUNDS:
                self._chunk_steps[engine_idx][bound].inc()

    def _placement_child(self, engine_idx: int, label: str):
        key = (engine_idx, label)
        if key not in self._placement_children:
            placement, _, reason = label.partition(":")
            self._placement_children[key] = self._placement_metric.labels(*self._labels[engine_idx], placement, reason)
        return self._placement_children[key]


def _per_transport(counter_cls, labelnames, per_engine_labelvalues) -> dict[int, dict[str, Any]]:
    """`pdserve:kv_peers_attached_total{transport=shm|nixl}`: peer incarnations attached, by the
    transport that reaches them (shm only for a peer proven on this host)."""
    metric = counter_cls(name="pdserve:kv_peers_attached", labelnames=[*labelnames, "transport"],
                         documentation="Peer incarnations attached, by the transport that reaches them.")
    return {idx: {t: metric.labels(*values, t) for t in ("shm", "nixl")}
            for idx, values in per_engine_labelvalues.items()}


def _digest_mismatches(counter_cls, labelnames, per_engine_labelvalues) -> dict[int, dict[str, Any]]:
    """`pdserve:kv_digest_mismatch_total{transport=shm|nixl|gpu-ipc, mode=write|read}`: transfers whose
    KV failed its digest on this decode instance (none of them served)."""
    metric = counter_cls(name="pdserve:kv_digest_mismatch", labelnames=[*labelnames, "transport", "mode"],
                         documentation="KV transfers whose received blocks differed from the prefill's digest.")
    return {idx: {f"{t}:{m}": metric.labels(*values, t, m) for t in ("shm", "nixl", "gpu-ipc") for m in DIGEST_MODES}
            for idx, values in per_engine_labelvalues.items()}
