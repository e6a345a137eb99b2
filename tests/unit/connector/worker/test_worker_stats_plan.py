"""The step plan says what happened; WorkerStats names it for /metrics (the label strings
PDPromMetrics counts under pdserve:placements_total and pdserve:local_chunk_steps_total)."""

from __future__ import annotations

from types import SimpleNamespace

from pdserve.config import TransferMode
from pdserve.connector.metadata import StepPlan
from pdserve.connector.worker.worker_stats import WorkerStats
from pdserve.placement import Decision, Placement, Reason
from pdserve.transfer.completions import TransferStats
from tests.unit.connector.harness import make_config


def test_a_plans_decisions_served_whole_requests_and_chunk_steps_become_their_metric_labels():
    stats = WorkerStats(make_config("kv_producer", TransferMode.WRITE))
    stats.on_plan(StepPlan(placements=[Decision(Placement.LOCAL, Reason.LOCAL_FASTER)], served_whole=2,
                           chunk_steps_over=[False, True]))
    engine = SimpleNamespace(stats=TransferStats())
    data = stats.take(engine, 0, [], SimpleNamespace(take_attached=lambda: []))
    assert data["placements"] == ["local:local_faster", "whole:serve_decode", "whole:serve_decode"]
    assert data["chunk_steps"] == ["within", "over"]
