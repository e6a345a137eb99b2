"""Stopping a transfer: no copy is left behind. P cancels what is queued, waits for what runs,
and only then says it stopped; D reuses its blocks only once no copy of P can land in them.
Slow copies come from a hook on P's real ShmTransport (it runs after a batch's bytes landed,
before the batch counts as done, so a sleeping hook is a copy that is still running)."""

from __future__ import annotations

import threading
import time

from pdserve.control.messages import ReadDone, Release, RemoteBlocks, WriteDone
from pdserve.transfer.specs import CancelSpec
from tests.unit.connector.harness import D_ADDRESS, P_ADDRESS, Pair
from tests.unit.transfer.transfers import D_BLOCKS, P_BLOCKS, READ, WRITE, moved, read_recv, send, write_recv


class CopyLog:
    """A copy hook that records when each batch ended and can hold batches back."""

    def __init__(self, sleep_s: float = 0.0, gate: threading.Event | None = None):
        self.sleep_s = sleep_s
        self.gate = gate
        self.entered = threading.Event()
        self.ended: list[float] = []

    def __call__(self, direction, ranges) -> None:
        self.entered.set()
        if self.gate is not None:
            self.gate.wait(5.0)
        time.sleep(self.sleep_s)
        self.ended.append(time.monotonic())


def sent_at(side, kind: type) -> float:
    return next(s.at for s in side.notifier.sent if isinstance(s.message, kind))


def announced(pair: Pair) -> None:
    """D announced t1 and P has it (held early); P's engine knows nothing of t1 yet."""
    pair.d.engine.add_recv(write_recv())
    pair.pump_until(lambda: pair.d.notifier.delivered, sides=(pair.d,))


def test_p_cancel_stops_queued_copies_and_confirms_only_after_the_running_one_ended():
    """Finding 3 (engine): a preempted prefill's CancelSpec arrives while layer 0 is copying and
    layer 1 is queued: layer 1 must never be copied, WriteDone(ok=False) must wait for layer 0."""
    with Pair(WRITE) as pair:
        gate = threading.Event()
        log = CopyLog(gate=gate)
        pair.p.transport.set_copy_hook(log)
        d_before, p_bytes = pair.d.snapshot(), pair.p.snapshot()
        announced(pair)
        send(pair.p, layers=[])
        pair.pump_until(lambda: pair.d.handshakes == 1, sides=(pair.p,))
        pair.pump_for(0.05, sides=(pair.p,))  # P applies its handshake with D: each layer is now one batch
        pair.p.engine.layer_ready(0)
        pair.p.engine.layer_ready(1)
        assert log.entered.wait(2.0), "layer 0 never started copying"
        pair.p.engine.cancel(CancelSpec("t1", D_ADDRESS, "the prefill request was preempted before its KV was sent"))
        pair.p.finished_req_ids.add("req-p")
        pair.pump_for(0.1)
        assert pair.p.notifier.messages(WriteDone) == [], "P said it stopped while a copy was running"
        assert pair.d.recving == set() and pair.p.sending == set()
        gate.set()
        pair.pump_until(lambda: "req-d" in pair.d.recving and "req-p" in pair.p.sending)
        [done] = pair.p.notifier.messages(WriteDone)
        assert not done.ok and "preempted" in done.error
        assert len(log.ended) == 1, "the queued layer was copied after the cancel"
        assert log.ended[0] <= sent_at(pair.p, WriteDone) <= pair.d.reported_at["req-d"]
        assert pair.d.failed_recving == {"req-d"}
        layer0 = moved(p_bytes, P_BLOCKS, d_before, D_BLOCKS)
        assert pair.d.snapshot() == {k: (layer0[k] if k[0] == 0 else d_before[k]) for k in d_before}
        assert not pair.p.engine.has_active() and not pair.d.engine.has_active()


def test_d_gives_up_but_frees_its_blocks_only_after_p_slow_copy_ended(live_process):
    """Finding 4: D's transfer times out while P's copy (longer than release_grace) still runs.
    P is alive on this host and answers, so D must not fall back on the time fence: it sends
    Release and reports the failure (letting vLLM reuse the blocks) only after P's
    WriteDone(ok=False), which P sends once its running copy has ended."""
    with Pair(WRITE, d_timeouts={"transfer_timeout": 0.3, "release_grace": 0.1}) as pair:
        pair.p.liveness = live_process.start()
        log = CopyLog(sleep_s=0.6)
        pair.p.transport.set_copy_hook(log)
        announced(pair)
        send(pair.p)
        pair.p.finished_req_ids.add("req-p")
        pair.pump_until(lambda: "req-d" in pair.d.recving and "req-p" in pair.p.sending, timeout_s=3.0)
        assert pair.d.failed_recving == {"req-d"}
        assert log.ended, "P's copy never ran"
        release, copy_end = sent_at(pair.d, Release), log.ended[0]
        done, failed = sent_at(pair.p, WriteDone), pair.d.reported_at["req-d"]
        assert release < copy_end, "the copy was meant to outlast D's deadline"
        assert failed >= copy_end, f"D reported failure {copy_end - failed:.3f} s before P's copy ended"
        assert copy_end <= done <= failed
        assert len(log.ended) == 1, "P started a copy after D released the transfer"


def test_d_write_fails_at_the_fence_when_p_never_answers_the_release():
    """P unreachable after the announcement: D can only rely on P's write fence (announcement +
    write_for + release_grace), and must wait for it."""
    with Pair(WRITE, d_timeouts={"transfer_timeout": 0.2, "release_grace": 0.2}) as pair:
        start = time.monotonic()
        pair.d.engine.add_recv(write_recv())
        pair.pump_until(lambda: pair.d.notifier.messages(RemoteBlocks), sides=(pair.d,))
        write_for = pair.d.notifier.messages(RemoteBlocks)[0].write_for
        announced_at = sent_at(pair.d, RemoteBlocks)
        pair.pump_until(lambda: "req-d" in pair.d.recving, sides=(pair.d,))
        assert pair.d.failed_recving == {"req-d"}
        assert time.monotonic() >= announced_at + write_for + 0.2 * 0.9
        assert time.monotonic() - start >= 0.4 * 0.9


def test_notify_failure_on_d_write_fails_at_once_without_blocking():
    """Finding 10: D cannot even queue its announcement: nothing can be written, so it fails at
    once (no fence to wait for) and no pump call blocks."""
    with Pair(WRITE, d_timeouts={"transfer_timeout": 2.0}) as pair:
        pair.d.notifier.refuse = True
        pair.d.engine.add_recv(write_recv())
        elapsed, longest = pump_timed(pair, lambda: "req-d" in pair.d.recving, sides=(pair.d,))
        assert pair.d.failed_recving == {"req-d"}
        assert elapsed < 1.0 and longest < 0.25
        assert pair.p.engine.has_active() is False


def test_notify_failure_on_d_read_fails_within_the_transfer_deadline():
    with Pair(READ, d_timeouts={"transfer_timeout": 0.3}) as pair:
        pair.d.notifier.refuse = True  # the ReadDone cannot be queued
        pair.d.engine.add_recv(read_recv())
        elapsed, longest = pump_timed(pair, lambda: "req-d" in pair.d.recving, sides=(pair.d,))
        assert pair.d.failed_recving == {"req-d"}
        assert elapsed < 0.3 + 0.5 and longest < 0.25
        assert pair.d.notifier.messages(ReadDone), "D read and tried to confirm"


def test_notify_failure_on_p_write_lets_d_fail_within_its_deadline_and_fence():
    """P wrote everything but cannot queue WriteDone: D never learns it, gives up at its deadline
    and reports failure (recompute) by the fence; nothing blocks on either side."""
    with Pair(WRITE, d_timeouts={"transfer_timeout": 0.3, "release_grace": 0.1}) as pair:
        pair.p.notifier.refuse = True
        announced(pair)
        send(pair.p)
        pair.p.finished_req_ids.add("req-p")
        elapsed, longest = pump_timed(pair, lambda: "req-d" in pair.d.recving and "req-p" in pair.p.sending)
        assert pair.d.failed_recving == {"req-d"}
        assert elapsed < 0.3 + 0.1 + 0.5 and longest < 0.25


def pump_timed(pair: Pair, condition, sides=None, timeout_s: float = 3.0) -> tuple[float, float]:
    """Pump until `condition()`; returns (seconds it took, longest single pump round)."""
    start = time.monotonic()
    longest = 0.0
    while not condition():
        began = time.monotonic()
        pair.pump(sides)
        longest = max(longest, time.monotonic() - began)
        assert time.monotonic() - start < timeout_s, pair.summary()
        time.sleep(0.002)
    return time.monotonic() - start, longest


def test_p_never_starts_a_copy_after_d_write_fence():
    """P's copies carry the end of D's write window as `not_after`: a batch still queued behind a slow one when
    the fence passes is refused by the transport, so D may reuse its blocks after the fence even
    though its Release never reached P."""
    with Pair(WRITE, d_timeouts={"transfer_timeout": 0.3, "release_grace": 0.1}) as pair:
        gate = threading.Event()
        log = CopyLog(gate=gate)
        pair.p.transport.set_copy_hook(log)
        d_before = pair.d.snapshot()
        pair.d.engine.add_recv(write_recv("req-d0", "t0", blocks=(0, 1, 2, 3)))
        pair.d.engine.add_recv(write_recv("req-d1", "t1", blocks=D_BLOCKS))
        pair.pump_until(lambda: len(pair.d.notifier.delivered) == 2, sides=(pair.d,))
        pair.d.notifier.drop = True  # D's Releases are lost: only the fence protects t1's blocks
        send(pair.p, "req-p0", "t0")
        send(pair.p, "req-p1", "t1")
        pair.pump_until(lambda: log.entered.is_set(), sides=(pair.p,))  # t0 copies, t1 queues behind it
        pair.pump_until(lambda: {"req-d0", "req-d1"} <= pair.d.recving, sides=(pair.d,))
        gate.set()
        pair.p.finished_req_ids |= {"req-p0", "req-p1"}
        pair.pump_until(lambda: {"req-p0", "req-p1"} <= pair.p.sending, sides=(pair.p,))
        assert pair.d.failed_recving == {"req-d0", "req-d1"}
        assert len(log.ended) == 1, "t1 was copied after its fence"
        assert all(pair.d.read_block(layer, b) == d_before[(layer, b)] for layer in range(2) for b in D_BLOCKS)
        t1_done = next(m for m in pair.p.notifier.messages(WriteDone) if m.transfer_id == "t1")
        assert not t1_done.ok and "deadline passed" in t1_done.error


def test_announcement_whose_write_window_already_closed_is_never_written():
    with Pair(WRITE) as pair:
        d_before = pair.d.snapshot()
        late = RemoteBlocks("t1", list(D_BLOCKS), 0, write_recv().prompt_hash, 0.0)
        pair.p.engine.on_message(pair.d.identity, late)
        send(pair.p)
        pair.p.finished_req_ids.add("req-p")
        pair.pump_until(lambda: "req-p" in pair.p.sending, sides=(pair.p,))
        [done] = pair.p.notifier.messages(WriteDone)
        assert not done.ok and "write deadline passed" in done.error
        assert pair.d.snapshot() == d_before


def test_d_cancel_before_its_handshake_finished_still_releases_p():
    """D cancels (request aborted) while its handshake with P is still running: once it knows
    P's incarnation it must tell P to let go, or P keeps the blocks until defer_timeout."""
    with Pair(WRITE, p_timeouts={"defer_timeout": 2.0}) as pair:
        pair.p.handshake_delay_s = 0.1
        pair.d.engine.add_recv(write_recv())
        pair.d.engine.cancel(CancelSpec("t1", P_ADDRESS, "request aborted"))
        send(pair.p)
        pair.p.finished_req_ids.add("req-p")
        elapsed = pair.pump_until(lambda: "req-d" in pair.d.recving and "req-p" in pair.p.sending, timeout_s=2.5)
        assert elapsed < 1.0, "P held its blocks for defer_timeout: D never released it"
        assert [m.transfer_id for m in pair.d.notifier.messages(Release)] == ["t1"]
        assert pair.d.failed_recving == {"req-d"}


def test_release_for_a_write_p_already_ended_is_answered_so_d_need_not_wait_the_fence():
    """P finished t1 but its WriteDone was lost: D gives up at its deadline and sends Release.
    P will never write t1 again, so it says so (WriteDone ok=False) instead of ignoring the
    Release and leaving D to wait for the fence (release_grace, or longer for a live P)."""
    with Pair(WRITE, d_timeouts={"transfer_timeout": 0.3, "release_grace": 1.5}) as pair:
        announced(pair)
        pair.p.notifier.drop = True  # P's WriteDone(ok) is lost
        send(pair.p)
        pair.p.finished_req_ids.add("req-p")
        pair.pump_until(lambda: "req-p" in pair.p.sending, sides=(pair.p,))
        pair.p.notifier.drop = False
        elapsed = pair.pump_until(lambda: "req-d" in pair.d.recving, timeout_s=3.0)
        assert pair.d.failed_recving == {"req-d"}
        assert elapsed < 1.0, f"D waited {elapsed:.1f} s for the fence although P had ended the transfer"
        assert [m.ok for m in pair.p.notifier.messages(WriteDone)] == [True, False]
