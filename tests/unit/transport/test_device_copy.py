"""DeviceCopier: a copy waits for its ready event, keeps at most AHEAD windows in flight, and
reports its end only once every window it issued completed; deadline and peer checked per window.

A manual backend stands in for the GPU: copies land at once (CPU tensors), events complete only
when the test says, as a stream's would later.
"""

from __future__ import annotations

import time
from contextlib import nullcontext

import pytest
import torch

from pdserve.transport.copy_plan import plan_windows
from pdserve.transport.device import CPU
from pdserve.transport.device_copy import DeviceCopier, DeviceCopy, Part

WINDOW = 1024
AHEAD_WINDOWS = 2  # the copier under test keeps two windows' bytes in flight


class Event:
    def __init__(self):
        self.complete = False

    def query(self) -> bool:
        return self.complete


class ManualBackend:
    device = CPU

    def __init__(self):
        self.events: list[Event] = []
        self.fail_query = None

    def new_stream(self):
        return "side"

    def on_stream(self, stream):
        return nullcontext()

    def record(self, stream) -> Event:
        self.events.append(Event())
        return self.events[-1]

    def record_ready(self) -> Event:
        return Event()

    def done(self, event: Event) -> bool:
        if self.fail_query is not None:
            raise self.fail_query
        return event.query()

    def complete_all(self) -> None:
        for event in self.events:
            event.complete = True


class Run:
    """One copy of `num_windows` windows from `src` to `dst`, and its outcome."""

    def __init__(self, num_windows: int, not_after: float | None = None, ready: Event | None = None, peer_gone=None):
        self.src = torch.arange(num_windows * WINDOW, dtype=torch.int64).to(torch.uint8)
        self.dst = torch.zeros(num_windows * WINDOW, dtype=torch.uint8)
        windows = plan_windows([(0, 0, num_windows * WINDOW)], window_bytes=WINDOW)
        self.ended: list[DeviceCopy] = []
        self.copy = DeviceCopy([Part(self.src, self.dst, w) for w in windows], not_after, self.ended.append, ready,
                               peer_gone or (lambda: None))

    @property
    def landed(self) -> int:
        return int((self.dst == self.src).view(-1, WINDOW).all(dim=1).sum())


@pytest.fixture
def backend():
    return ManualBackend()


def test_nothing_is_issued_until_the_ready_event_completes(backend):
    ready = Event()
    run = Run(4, ready=ready)
    copier = DeviceCopier(backend, AHEAD_WINDOWS * WINDOW)
    copier.start(run.copy)
    copier.progress()
    assert run.landed == 0 and not backend.events
    ready.complete = True
    copier.progress()
    assert run.landed == AHEAD_WINDOWS and len(backend.events) == AHEAD_WINDOWS
    while not run.ended:
        backend.complete_all()
        copier.progress()
    assert run.landed == 4 and run.copy.error is None and not copier.busy


def test_a_copy_still_waiting_for_its_layer_at_the_deadline_fails_without_a_byte(backend):
    run = Run(2, not_after=time.monotonic() + 0.05, ready=Event())
    copier = DeviceCopier(backend, AHEAD_WINDOWS * WINDOW)
    copier.start(run.copy)
    time.sleep(0.1)
    copier.progress()
    assert run.ended and run.copy.error == "deadline passed before the copy started" and run.landed == 0


def test_at_the_deadline_issuing_stops_and_the_copy_ends_only_when_its_windows_completed(backend):
    run = Run(5, not_after=time.monotonic() + 0.1)
    copier = DeviceCopier(backend, AHEAD_WINDOWS * WINDOW)
    copier.start(run.copy)
    backend.events[0].complete = True
    copier.progress()  # window 0 done, window 2 issued
    time.sleep(0.15)
    copier.progress()
    assert not run.ended, "reported over while windows were still in flight"
    backend.complete_all()
    copier.progress()
    assert run.copy.error == f"deadline passed during the copy ({3 * WINDOW} of {5 * WINDOW} bytes moved)"
    assert run.landed == 3 and len(backend.events) == 3


def test_a_peer_gone_stops_the_copy_before_its_next_window(backend):
    gone = []
    run = Run(4, peer_gone=lambda: gone[0] if gone else None)
    copier = DeviceCopier(backend, AHEAD_WINDOWS * WINDOW)
    copier.start(run.copy)
    gone.append("process 7 that exported the region has exited")
    backend.complete_all()
    copier.progress()
    assert run.copy.error == f"process 7 that exported the region has exited ({2 * WINDOW} of {4 * WINDOW} bytes moved)"
    early = Run(2, peer_gone=lambda: "process 7 that exported the region has exited")
    copier.start(early.copy)
    assert early.copy.error == "process 7 that exported the region has exited" and early.landed == 0


def test_a_window_that_fails_to_enqueue_fails_the_copy_after_what_was_issued(backend, monkeypatch):
    from pdserve.transport import device_copy

    run = Run(3)
    calls = []

    def enqueue(src, dst, window):
        calls.append(window)
        if len(calls) == 2:
            raise RuntimeError("out of memory")
        return []

    monkeypatch.setattr(device_copy, "enqueue_window", enqueue)
    copier = DeviceCopier(backend, AHEAD_WINDOWS * WINDOW)
    copier.start(run.copy)
    assert not run.ended
    backend.complete_all()
    copier.progress()
    assert run.copy.error == f"copy failed: RuntimeError: out of memory ({WINDOW} of {3 * WINDOW} bytes moved)"


def test_a_device_error_while_polling_ends_the_copy(backend):
    run = Run(2)
    copier = DeviceCopier(backend, AHEAD_WINDOWS * WINDOW)
    copier.start(run.copy)
    backend.fail_query = RuntimeError("illegal memory access")
    copier.progress()
    assert run.ended and "illegal memory access" in run.copy.error and not copier.busy


def test_stop_all_issues_nothing_more_and_settles(backend):
    runs = [Run(4), Run(4, ready=Event())]
    copier = DeviceCopier(backend, AHEAD_WINDOWS * WINDOW)
    for run in runs:
        copier.start(run.copy)
    copier.stop_all("transport closed during the transfer")
    assert runs[1].ended and runs[1].copy.error == "transport closed during the transfer"
    assert not runs[0].ended
    backend.complete_all()
    copier.progress()
    assert runs[0].copy.error.startswith("transport closed during the transfer (2048 of 4096")
