"""`DeviceCopier`: runs copies on one side stream, each after its ready event, within its deadline.

A `DeviceCopy` is one batch's byte moves, as windows (copy_plan.py) between byte tensors. Its
life, driven by `progress` on the transport's copy thread:
1. WAITING until its ready event completed: the KV it moves is written. A copy is enqueued only
   then, never queued behind computation on the GPU, because nothing enqueued on a stream can be
   withdrawn: a copy waiting on the device for a slow layer could land any time later, past its
   deadline. Past the deadline while waiting, it fails having moved nothing.
2. ISSUING its windows on the side stream, each followed by an event, while less than
   AHEAD_BYTES of it are in flight. Before each window the deadline and the peer (`peer_gone`)
   are checked; either stops the copy. Once stopped, at most AHEAD_BYTES plus one window of it
   still land.
3. SETTLING: every window issued has completed (its event), so no byte of the copy moves any
   more; only now `on_done` is called, with None or the error. A copy never reports failure
   while bytes of it may still land (TransferHandle's rule).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

from pdserve.transport.copy_plan import WINDOW_BYTES, Window, enqueue_window
from pdserve.transport.copy_thread import past
from pdserve.transport.device_backend import DeviceBackend

logger = logging.getLogger(__name__)

AHEAD_BYTES = 2 * WINDOW_BYTES  # in flight per copy: the GPU stays busy while the next window is checked
DEADLINE_BEFORE = "deadline passed before the copy started"
DEADLINE_DURING = "deadline passed during the copy"


class Part(NamedTuple):
    """One window between two byte tensors."""

    src: object  # torch.Tensor
    dst: object
    window: Window


class _InFlight(NamedTuple):
    event: object
    num_bytes: int
    keep: list  # temporaries the window's kernels use


@dataclass(eq=False)
class DeviceCopy:
    parts: list[Part]
    not_after: float | None
    on_done: Callable[[DeviceCopy], None]  # called once, when settled; `error` says how it ended
    ready: object = None  # event to wait for; None: ready now
    peer_gone: Callable[[], str | None] = lambda: None
    next_part: int = 0
    in_flight: deque = field(default_factory=deque)
    moved: int = 0  # bytes of windows that completed
    stopped: str | None = None  # why no more windows are issued
    began: float | None = None  # perf_counter at the first window issued
    settled: float | None = None

    @property
    def num_bytes(self) -> int:
        return sum(part.window.num_bytes for part in self.parts)

    @property
    def error(self) -> str | None:
        """How a settled copy failed, None when every byte landed."""
        if self.stopped is None:
            return None
        if self.next_part == 0 and self.stopped == DEADLINE_DURING:
            return DEADLINE_BEFORE
        if self.next_part == 0:
            return self.stopped
        return f"{self.stopped} ({self.moved} of {self.num_bytes} bytes moved)"

    @property
    def seconds(self) -> float:
        """Time from the first window issued to the copy settled (0 when none was issued)."""
        return 0.0 if self.began is None or self.settled is None else self.settled - self.began


class DeviceCopier:
    """Drives DeviceCopy objects on one side stream of `backend` (module docstring). Used from the
    transport's copy thread only."""

    def __init__(self, backend: DeviceBackend, ahead_bytes: int = AHEAD_BYTES):
        self._backend = backend
        self._stream = backend.new_stream()
        self._ahead_bytes = ahead_bytes
        self._copies: list[DeviceCopy] = []

    @property
    def busy(self) -> bool:
        return bool(self._copies)

    def start(self, copy: DeviceCopy) -> None:
        self._copies.append(copy)
        self._advance(copy)

    def progress(self) -> None:
        for copy in list(self._copies):
            self._advance(copy)

    def stop_all(self, reason: str) -> None:
        """Issue nothing more for any copy; each settles once what it has in flight completed."""
        for copy in self._copies:
            copy.stopped = copy.stopped or reason
        self.progress()

    def _advance(self, copy: DeviceCopy) -> None:
        self._retire(copy)
        if copy.stopped is None:
            self._issue(copy)
        if copy.in_flight or (copy.stopped is None and (copy.ready is not None or copy.next_part < len(copy.parts))):
            return
        self._copies.remove(copy)
        copy.settled = time.perf_counter()
        copy.on_done(copy)

    def _retire(self, copy: DeviceCopy) -> None:
        try:
            while copy.in_flight and self._backend.done(copy.in_flight[0].event):
                copy.moved += copy.in_flight.popleft().num_bytes
        except Exception as exc:  # noqa: BLE001 - a device error: nothing of this stream runs any more
            logger.error("device copy: polling an event failed: %s", exc)
            copy.in_flight.clear()
            copy.stopped = copy.stopped or f"copy failed: {type(exc).__name__}: {exc}"

    def _issue(self, copy: DeviceCopy) -> None:
        backend = self._backend
        if copy.ready is not None:
            try:
                ready = backend.done(copy.ready)
            except Exception as exc:  # noqa: BLE001 - the compute stream failed: nothing to copy
                copy.stopped = f"copy failed: waiting for the KV to be written: {type(exc).__name__}: {exc}"
                return
            if not ready:
                if past(copy.not_after):
                    copy.stopped = DEADLINE_DURING
                return
            copy.ready = None
        if copy.next_part == len(copy.parts):
            return
        with backend.on_stream(self._stream):
            while (copy.next_part < len(copy.parts)
                   and sum(flight.num_bytes for flight in copy.in_flight) < self._ahead_bytes):
                if past(copy.not_after):
                    copy.stopped = DEADLINE_DURING
                    return
                gone = copy.peer_gone()
                if gone is not None:
                    copy.stopped = gone
                    return
                part = copy.parts[copy.next_part]
                if copy.began is None:
                    copy.began = time.perf_counter()
                try:
                    keep = enqueue_window(part.src, part.dst, part.window)
                    event = backend.record(self._stream)
                except Exception as exc:  # noqa: BLE001 - the failure reaches the copy's handle
                    copy.stopped = f"copy failed: {type(exc).__name__}: {exc}"
                    self._barrier(copy)
                    return
                copy.in_flight.append(_InFlight(event, part.window.num_bytes, keep))
                copy.next_part += 1

    def _barrier(self, copy: DeviceCopy) -> None:
        """After a window failed part-way: an event behind whatever of it was issued, so the copy
        settles only once that completed (or at once, when the device cannot even record one)."""
        try:
            copy.in_flight.append(_InFlight(self._backend.record(self._stream), 0, []))
        except Exception as exc:  # noqa: BLE001 - the device is unusable: nothing of the stream runs
            logger.error("device copy: cannot record an event after a failed window: %s", exc)
            copy.in_flight.clear()
