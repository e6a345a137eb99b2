"""`WorkerStats`: what the worker reports to the stats logger besides the engine's counters.

Filled by the step hooks (and, for handshake times, by handshake threads), drained by `take`
into the payload `PDConnectorStats` (stats.py) reads.
"""

from __future__ import annotations

import dataclasses
from collections import deque

from pdserve.config import ConnectorConfig, Role
from pdserve.connector.metadata import StepPlan
from pdserve.placement import OVER, WITHIN
from pdserve.transport.base import Transport

SERVED_WHOLE = "whole:serve_decode"  # the placement label of a request P served whole


class WorkerStats:
    def __init__(self, config: ConnectorConfig):
        self._config = config
        self._reported_rejections = 0
        self._handshake_seconds: deque[float] = deque()  # appended by handshake threads
        self._placements: list[str] = []  # D: this interval's placement decisions, "placement:reason"
        self._chunk_steps: list[str] = []  # D: this interval's steps with a local chunk, "within"/"over" their bound
        self._remote_paths: list[float] = []  # D: this interval's measured remote paths (remote_path.py)
        self._prefill_queue: list[int] = []  # P: queued prompt tokens it published, latest last

    def on_handshake(self, seconds: float) -> None:
        """Thread-safe: a handshake was answered (accepted or not) after `seconds`."""
        self._handshake_seconds.append(seconds)

    def on_plan(self, plan: StepPlan) -> None:
        if plan.load is not None and (not self._prefill_queue or self._prefill_queue[-1] != plan.load.queued_tokens):
            self._prefill_queue.append(plan.load.queued_tokens)
        self._placements.extend(decision.label for decision in plan.placements)
        self._placements.extend([SERVED_WHOLE] * plan.served_whole)
        self._chunk_steps.extend(OVER if over else WITHIN for over in plan.chunk_steps_over)
        self._remote_paths.extend(plan.remote_paths)

    def take(self, engine, num_rejected: int, serving: list[int], transport: Transport) -> dict | None:
        """The payload since the last call, or None when nothing happened. `num_rejected`: messages
        the servers rejected so far; `serving`: the decode-serving change (decode_serving.py)."""
        stats = engine.stats
        new_rejections, self._reported_rejections = num_rejected - self._reported_rejections, num_rejected
        handshakes = [self._handshake_seconds.popleft() for _ in range(len(self._handshake_seconds))]
        placements, self._placements = self._placements, []
        chunk_steps, self._chunk_steps = self._chunk_steps, []
        remote_paths, self._remote_paths = self._remote_paths, []
        queue, self._prefill_queue = self._prefill_queue[-1:], []
        if not (stats.num_completed or stats.num_failed or new_rejections or handshakes or placements or queue
                or serving or chunk_steps or remote_paths):
            return None
        stats = stats.take()
        recomputed = (stats.num_failed if self._config.role is Role.CONSUMER
                      and self._config.load_failure_policy == "recompute" else 0)
        return {**dataclasses.asdict(stats), "num_rejected": new_rejections, "num_recomputed": recomputed,
                "handshake_seconds": handshakes, "placements": placements, "prefill_queued_tokens": queue,
                "serving_decode": serving, "chunk_steps": chunk_steps, "remote_paths": remote_paths,
                "peers_attached": transport.take_attached()}
