"""RemotePath: what a prompt D sends to P costs its TTFT beyond P's compute, learnt from those it sent.

D estimates a remote prefill's TTFT as the time P needs to compute its queue and the prompt
(`drain_seconds`, from P's published step costs) plus the path around it: P's wait for D's word,
the KV's landing, D's pick-up of the landed request at its next step boundary and the step that
gives the first token. Several of D's steps are in that path, so a fixed guess would make D take
remote prompts for faster than they are, and send P a queue that breaks TTFT bounds plain serving
meets.

So D measures it: for each prompt it sends with an estimate, the time from its decision to the end
of its first step after the KV landed (the step that computes the first token), minus the compute
the estimate assumed. The median of the last WINDOW such samples is the path of the next
estimates (the configured `transfer_overhead_ms` until MIN_SAMPLES are in, or instead, where the
deployment sets it). What the estimate of P's queue misses lands in the samples too, so the path
follows the load. Free of vLLM.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from dataclasses import dataclass

import numpy as np

WINDOW = 40
MIN_SAMPLES = 8
MAX_PENDING = 4096  # prompts on their way at once; the oldest is forgotten beyond it


@dataclass
class _Pending:
    decided_at: float
    compute_s: float  # P's compute the estimate assumed (queue and prompt)


class RemotePath:
    def __init__(self, window: int = WINDOW, clock=time.monotonic):
        self._clock = clock
        self._pending: OrderedDict[str, _Pending] = OrderedDict()
        self._landed: list[str] = []  # of the pending, those whose KV landed since the last step ended
        self._samples: deque[float] = deque(maxlen=window)
        self._seconds: float | None = None

    def placed(self, request_id: str, compute_s: float) -> None:
        """D just sent `request_id` to P, estimating P's compute for it (its queue first) at `compute_s`."""
        self._pending[request_id] = _Pending(self._clock(), max(0.0, compute_s))
        while len(self._pending) > MAX_PENDING:
            self._pending.popitem(last=False)

    def landed(self, request_id: str) -> None:
        """Its KV landed: the next step D finishes gives it its first token."""
        if request_id in self._pending:
            self._landed.append(request_id)

    def forget(self, request_id: str) -> None:
        self._pending.pop(request_id, None)

    def step_ended(self) -> list[float]:
        """A step of D's ended: the prompts that had landed before it took their first token in it.
        Returns their samples (seconds of path each)."""
        now = self._clock()
        done, self._landed = self._landed, []
        samples = []
        for rid in done:
            pending = self._pending.pop(rid, None)  # None: forgotten meanwhile, or reported twice
            if pending is not None:
                samples.append(max(0.0, now - pending.decided_at - pending.compute_s))
        if samples:
            self._samples.extend(samples)
            if len(self._samples) >= MIN_SAMPLES:
                self._seconds = float(np.median(np.fromiter(self._samples, dtype=float)))
        return samples

    def seconds(self) -> float | None:
        """The path's length by the last samples (None: fewer than MIN_SAMPLES yet)."""
        return self._seconds


__all__ = ["MAX_PENDING", "MIN_SAMPLES", "RemotePath", "WINDOW"]
