"""PDConnectorStats (what vLLM aggregates between steps and workers) and PDPromMetrics (what it
turns into /metrics), with prometheus_client's real metric classes on a private registry."""

from __future__ import annotations

import copy
import dataclasses
import functools
import types

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from pdserve.config import TransferMode
from pdserve.connector.stats import DURATION_BUCKETS_S, SIZE_BUCKETS_BYTES, PDConnectorStats, PDPromMetrics
from pdserve.transfer.specs import RecvSpec, SendSpec
from tests.unit.connector.harness import BLOCK_BYTES, D_ADDRESS, NUM_LAYERS, P_ADDRESS, PROMPT_HASH, Pair

LABELS = {"model_name": "tiny", "engine": "0"}


def prom_metrics() -> tuple[PDPromMetrics, CollectorRegistry]:
    registry = CollectorRegistry()
    types_ = {cls: functools.partial(cls, registry=registry) for cls in (Gauge, Counter, Histogram)}
    vllm_config = types.SimpleNamespace(kv_transfer_config=None)
    return PDPromMetrics(vllm_config, types_, list(LABELS), {0: list(LABELS.values())}), registry


def sample(registry: CollectorRegistry, name: str, **labels: str) -> float | None:
    return registry.get_sample_value(name, {**LABELS, **labels})


def buckets(registry: CollectorRegistry, name: str) -> list[tuple[float, float]]:
    """(upper bound, cumulative count) of every bucket of `name`, in bound order."""
    found = [(float(s.labels["le"]), s.value) for metric in registry.collect() for s in metric.samples
             if s.name == f"{name}_bucket"]
    return sorted(found)


def bucket(registry: CollectorRegistry, name: str, bound: float) -> float:
    """The cumulative count of `name`'s bucket whose upper bound is `bound`."""
    [count] = [count for le, count in buckets(registry, name) if le == bound]
    return count


def stats(**data) -> PDConnectorStats:
    out = PDConnectorStats()
    out.data.update(data)
    return out


def test_fresh_stats_are_empty_and_any_single_observation_is_not():
    assert PDConnectorStats().is_empty()
    for data in ({"num_completed": 1}, {"num_rejected": 2}, {"handshake_seconds": [0.01]}, {"num_fenced": 1}):
        assert not stats(**data).is_empty(), data


def test_aggregate_sums_counters_and_concatenates_per_event_lists():
    a = stats(num_completed=2, num_bytes=300, seconds=[0.1, 0.2], transfer_bytes=[100, 200], handshake_seconds=[0.5])
    b = stats(num_completed=1, num_failed=1, num_bytes=50, seconds=[0.3], transfer_bytes=[50], num_rejected=4)
    b_before = copy.deepcopy(b.data)
    merged = a.aggregate(b)
    assert (merged.data["num_completed"], merged.data["num_failed"], merged.data["num_bytes"]) == (3, 1, 350)
    assert merged.data["seconds"] == [0.1, 0.2, 0.3] and merged.data["transfer_bytes"] == [100, 200, 50]
    assert merged.data["handshake_seconds"] == [0.5] and merged.data["num_rejected"] == 4
    assert b.data == b_before, "aggregate changed its argument"
    assert merged.reduce() == {"transfers_completed": 3, "transfers_failed": 1, "bytes": 350,
                               "avg_transfer_ms": 200.0, "handshakes": 1}


def test_aggregate_accepts_a_payload_without_the_newer_keys():
    merged = PDConnectorStats().aggregate(PDConnectorStats(data={"num_completed": 1, "seconds": [0.2]}))
    assert merged.data["num_completed"] == 1 and merged.data["handshake_seconds"] == []


def test_observe_fills_one_histogram_sample_per_transfer_and_per_handshake_beside_the_counters():
    metrics, registry = prom_metrics()
    metrics.observe(stats(num_completed=3, num_bytes=3 * 4096 + 1, seconds=[0.002, 0.04, 12.0],
                          transfer_bytes=[4096, 4096, 4097], handshake_seconds=[0.003], num_rejected=1).data)
    metrics.observe(stats(num_completed=1, num_bytes=2 * 2**30, seconds=[0.7], transfer_bytes=[2 * 2**30]).data)
    assert sample(registry, "pdserve:kv_transfers_completed_total") == 4
    assert sample(registry, "pdserve:control_messages_rejected_total") == 1
    duration = "pdserve:kv_transfer_duration_seconds"
    assert sample(registry, f"{duration}_count") == 4
    assert abs(sample(registry, f"{duration}_sum") - 12.742) < 1e-9
    assert bucket(registry, duration, 0.0025) == 1
    assert bucket(registry, duration, 0.05) == 2
    assert bucket(registry, duration, 1.0) == 3
    assert bucket(registry, duration, 10.0) == 3
    assert bucket(registry, duration, 30.0) == 4
    size = "pdserve:kv_transfer_size_bytes"
    assert sample(registry, f"{size}_count") == 4 and sample(registry, f"{size}_sum") == 3 * 4096 + 1 + 2 * 2**30
    assert bucket(registry, size, 4096.0) == 2, "a bucket's bound is inclusive"
    assert bucket(registry, size, 8192.0) == 3
    assert bucket(registry, size, float(2**31)) == 4
    handshake = "pdserve:kv_handshake_duration_seconds"
    assert sample(registry, f"{handshake}_count") == 1 and bucket(registry, handshake, 0.0025) == 0
    for name in (duration, size, handshake):
        counts = [count for _, count in buckets(registry, name)]
        assert counts == sorted(counts) and counts[-1] == sample(registry, f"{name}_count"), name


def test_bucket_bounds_span_milliseconds_to_a_minute_and_kibibytes_to_gibibytes():
    for bounds in (DURATION_BUCKETS_S, SIZE_BUCKETS_BYTES):
        assert list(bounds) == sorted(set(bounds))
    assert DURATION_BUCKETS_S[0] == 0.001 and DURATION_BUCKETS_S[-1] >= 30.0  # the default transfer timeout
    assert SIZE_BUCKETS_BYTES[0] == 1024 and SIZE_BUCKETS_BYTES[-1] >= 2**30


def test_a_completed_transfer_reaches_the_histograms_with_its_bytes_and_duration():
    blocks = (0, 1, 2)
    with Pair(TransferMode.WRITE) as pair:
        pair.d.engine.add_recv(RecvSpec("req-d", "t1", TransferMode.WRITE, P_ADDRESS, blocks, 0, None, None, PROMPT_HASH))
        pair.p.engine.begin_step()
        pair.p.engine.add_send(SendSpec("req-p", "t1", D_ADDRESS, blocks, PROMPT_HASH))
        for layer in range(NUM_LAYERS):
            pair.p.engine.layer_ready(layer)
        pair.pump_until(lambda: "req-d" in pair.d.recving)
        for side in (pair.p, pair.d):
            data = dataclasses.asdict(side.engine.stats)
            assert data["transfer_bytes"] == [len(blocks) * NUM_LAYERS * BLOCK_BYTES], side.name
            assert len(data["seconds"]) == 1 and 0 < data["seconds"][0] < 5.0
            metrics, registry = prom_metrics()
            metrics.observe(PDConnectorStats(data=data).data)
            assert bucket(registry, "pdserve:kv_transfer_size_bytes", 1024) == 1
            assert sample(registry, "pdserve:kv_transfer_duration_seconds_count") == 1


def test_chunk_steps_count_by_whether_they_kept_their_bound():
    metrics, registry = prom_metrics()
    metrics.observe(stats(chunk_steps=["within", "within", "over"]).data)
    metrics.observe(stats(chunk_steps=["within", "bogus"]).data)  # an unknown label is not counted
    assert sample(registry, "pdserve:local_chunk_steps_total", bound="within") == 3
    assert sample(registry, "pdserve:local_chunk_steps_total", bound="over") == 1
    assert not stats(chunk_steps=["over"]).is_empty()


def test_remote_paths_reach_their_histogram_one_sample_each():
    metrics, registry = prom_metrics()
    metrics.observe(stats(remote_paths=[0.07, 0.09]).data)
    metrics.observe(stats(remote_paths=[0.3]).data)
    assert sample(registry, "pdserve:remote_path_seconds_count") == 3
    assert sample(registry, "pdserve:remote_path_seconds_sum") == pytest.approx(0.46)
    assert bucket(registry, "pdserve:remote_path_seconds", 0.1) == 2
    assert not stats(remote_paths=[0.07]).is_empty()
