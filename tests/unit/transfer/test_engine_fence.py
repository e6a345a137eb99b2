"""D's write window and fence (defect 1): D reports a WRITE transfer failed (which lets vLLM reuse
its blocks) only when no copy of P's can land in those blocks any more, whatever P's clock says,
however slow P's copy is, and whether or not P is frozen on this host."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

from pdserve.control.messages import Release, RemoteBlocks, WriteDone
from pdserve.transfer.incarnation import boot_id, process_start_time
from tests.unit.connector.harness import Pair
from tests.unit.transfer.transfers import WRITE, send, write_recv

SKEW_S = 20.0
SHORT = {"transfer_timeout": 0.3, "release_grace": 0.1}


def pump_with_p_clock(pair: Pair, monkeypatch, skew_s: float, until, timeout_s: float = 3.0) -> None:
    """Pump both sides until `until()`, P's wall clock `skew_s` behind D's (the engines share
    one process, so P's calls run with time.time patched)."""
    real = time.time
    deadline = time.monotonic() + timeout_s
    while not until():
        assert time.monotonic() < deadline, pair.summary()
        with monkeypatch.context() as m:
            m.setattr(time, "time", lambda: real() - skew_s)
            pair.p.pump()
        pair.d.pump()
        time.sleep(0.002)


def test_p_whose_clock_is_behind_writes_nothing_after_d_reported_the_failure(monkeypatch):
    """P's clock runs 20 s behind D's and its forward pass ends after D's window; D's Release
    is lost on the way. P must not write the blocks D has already handed back to vLLM."""
    with Pair(WRITE, d_timeouts=SHORT) as pair:
        pair.d.engine.add_recv(write_recv())
        pump_with_p_clock(pair, monkeypatch, SKEW_S, lambda: pair.d.notifier.delivered)
        pair.d.notifier.drop = True  # nothing more of D's reaches P
        with monkeypatch.context() as m:
            real = time.time
            m.setattr(time, "time", lambda: real() - SKEW_S)
            send(pair.p, layers=[])  # the prefill is planned; its layers are computed late
        pump_with_p_clock(pair, monkeypatch, SKEW_S, lambda: "req-d" in pair.d.recving)
        assert pair.d.failed_recving == {"req-d"}
        handed_back = pair.d.snapshot()
        with monkeypatch.context() as m:
            real = time.time
            m.setattr(time, "time", lambda: real() - SKEW_S)
            pair.p.engine.all_layers_ready()
        pair.p.finished_req_ids.add("req-p")
        pump_with_p_clock(pair, monkeypatch, SKEW_S, lambda: "req-p" in pair.p.sending)
        pair.pump_for(0.1)
        assert pair.d.snapshot() == handed_back, "P wrote blocks D had already handed back"
        [done] = pair.p.notifier.messages(WriteDone)
        assert not done.ok


def test_copy_stalled_past_the_window_lands_nothing_after_d_reported_the_failure():
    """P (elsewhere: D cannot watch its process) begins a copy inside the window and stalls past
    D's fence: the copy must land nothing once D has reported the failure."""
    with Pair(WRITE, d_timeouts=SHORT) as pair:
        stalled = threading.Event()
        pair.p.transport.set_stall_hook(lambda direction: (stalled.set(), time.sleep(0.6)))
        pair.d.engine.add_recv(write_recv())
        pair.pump_until(lambda: pair.d.notifier.delivered, sides=(pair.d,))
        send(pair.p)
        pair.p.finished_req_ids.add("req-p")
        pair.pump_until(lambda: "req-d" in pair.d.recving)
        assert stalled.is_set(), "P's copy never began"
        assert pair.d.failed_recving == {"req-d"}
        handed_back = pair.d.snapshot()
        pair.pump_until(lambda: "req-p" in pair.p.sending, timeout_s=3.0)
        pair.pump_for(0.1)
        assert pair.d.snapshot() == handed_back, "a stalled copy landed after D handed its blocks back"
        [done] = pair.p.notifier.messages(WriteDone)
        assert not done.ok


def test_d_waits_for_a_frozen_p_on_this_host_until_its_copy_ended(live_process):
    """P lives on this host but is frozen (SIGSTOP: it runs no more) with a copy in progress: D
    must neither trust the fence nor give up after transfer_timeout; it keeps asking (Release)
    and reports the failure only after P's copy ended and P answered."""
    with Pair(WRITE, d_timeouts={"transfer_timeout": 0.2, "release_grace": 0.1}) as pair:
        pair.p.liveness = live_process.start()
        os.kill(pair.p.liveness[0], signal.SIGSTOP)
        gate, entered, ended = threading.Event(), threading.Event(), []
        pair.p.transport.set_copy_hook(lambda d, r: (entered.set(), gate.wait(10), ended.append(time.monotonic())))
        pair.d.engine.add_recv(write_recv())
        pair.pump_until(lambda: pair.d.notifier.delivered, sides=(pair.d,))
        send(pair.p)
        pair.p.finished_req_ids.add("req-p")
        pair.pump_until(entered.is_set, sides=(pair.p,))
        pair.pump_for(1.2)  # fence (0.3 s) + transfer_timeout (0.2 s), twice over
        assert "req-d" not in pair.d.recving, "D gave up while a frozen P's copy was still running"
        assert len(pair.d.notifier.messages(Release)) >= 2, "D did not ask the silent P again"
        gate.set()
        pair.pump_until(lambda: "req-d" in pair.d.recving, timeout_s=3.0)
        assert pair.d.failed_recving == {"req-d"}
        assert pair.d.reported_at["req-d"] >= ended[0]


def test_d_gives_up_on_a_running_p_on_this_host_that_never_answers():
    """P lives on this host and runs (its CPU time grows), but every WriteDone it sends is lost:
    D reuses its blocks once P has run since the fence and transfer_timeout more passed."""
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        with Pair(WRITE, d_timeouts={"transfer_timeout": 0.2, "release_grace": 0.1}) as pair:
            start_time = process_start_time(busy.pid)
            assert start_time is not None
            pair.p.liveness = (busy.pid, start_time, boot_id())
            pair.d.engine.add_recv(write_recv())
            pair.pump_until(lambda: pair.d.notifier.delivered, sides=(pair.d,))
            announced_at = next(s.at for s in pair.d.notifier.sent if isinstance(s.message, RemoteBlocks))
            pair.p.notifier.drop = True
            send(pair.p)
            pair.p.finished_req_ids.add("req-p")
            pair.pump_until(lambda: "req-d" in pair.d.recving, timeout_s=3.0)
            assert pair.d.failed_recving == {"req-d"}
            write_for = pair.d.notifier.messages(RemoteBlocks)[0].write_for
            assert pair.d.reported_at["req-d"] >= announced_at + write_for + 0.1 + 0.2
    finally:
        busy.kill()
        busy.wait(5)
