"""Control messages that come early, late, twice or out of order: held with a deadline, answered
when they must be, applied once, and never able to revive or double-report a transfer."""

from __future__ import annotations

import time

from pdserve.control.messages import ReadAck, ReadDone, Release, RemoteBlocks, WriteDone
from pdserve.transfer.specs import CancelSpec
from tests.unit.connector.harness import D_ADDRESS, D_IDENTITY, P_IDENTITY, Pair
from tests.unit.transfer.transfers import (
    D_BLOCKS,
    P_BLOCKS,
    READ,
    WRITE,
    hold,
    moved,
    read_recv,
    remote_blocks,
    send,
    write_done,
    write_recv,
)


def test_read_done_before_the_hold_was_registered_is_answered_once_it_exists():
    """Finding 6: P's worker registers the hold a step after vLLM finished the request, and D can
    be faster. The ReadDone is held (up to defer_timeout, not a fixed 0.5 s) and answered the
    moment the hold appears; no thread waits for it meanwhile."""
    with Pair(READ) as pair:
        p_bytes, d_before = pair.p.snapshot(), pair.d.snapshot()
        pair.d.engine.add_recv(read_recv())
        pair.pump_until(lambda: pair.d.notifier.delivered, sides=(pair.d,))
        started = time.monotonic()
        longest = 0.0
        while time.monotonic() - started < 0.8:
            began = time.monotonic()
            pair.pump()
            longest = max(longest, time.monotonic() - began)
            time.sleep(0.005)
        assert longest < 0.25, "a pump blocked waiting for the hold"
        assert pair.p.notifier.messages(ReadAck) == [] and pair.d.recving == set()
        hold(pair.p)
        pair.p.finished_req_ids.add("req-p")
        pair.pump_until(lambda: "req-d" in pair.d.recving and "req-p" in pair.p.sending, timeout_s=1.0)
        assert pair.d.failed_recving == set()
        assert pair.p.notifier.messages(ReadAck) == [ReadAck("t1", True, "")]
        assert pair.d.snapshot() == moved(p_bytes, P_BLOCKS, d_before, D_BLOCKS)


def test_early_read_done_that_no_hold_ever_claims_is_refused_at_defer_timeout():
    with Pair(READ, p_timeouts={"defer_timeout": 0.2}, d_timeouts={"transfer_timeout": 5.0}) as pair:
        pair.d.engine.add_recv(read_recv())
        pair.pump_until(lambda: pair.d.notifier.delivered, sides=(pair.d,))
        asked = time.monotonic()
        pair.pump_until(lambda: "req-d" in pair.d.recving)
        answered = next(s for s in pair.p.notifier.sent if isinstance(s.message, ReadAck))
        assert 0.2 * 0.9 <= answered.at - asked < 1.0
        assert not answered.message.ok and answered.recipient == D_IDENTITY
        assert pair.d.failed_recving == {"req-d"}, "D failed on P's answer, long before its own deadline"


def test_duplicate_remote_blocks_are_ignored():
    """A second announcement (a retry, or a forged one with other blocks) never redirects a write."""
    with Pair(WRITE) as pair:
        p_bytes, d_before = pair.p.snapshot(), pair.d.snapshot()
        pair.d.engine.add_recv(write_recv())
        pair.pump_until(lambda: pair.d.notifier.delivered, sides=(pair.d,))
        pair.p.engine.on_message(D_IDENTITY, remote_blocks(blocks=(0, 1, 2, 3)))
        pair.p.engine.on_message(D_IDENTITY, remote_blocks())
        send(pair.p)
        pair.pump_until(lambda: "req-d" in pair.d.recving)
        pair.pump_for(0.05)
        assert pair.d.failed_recving == set()
        assert pair.d.snapshot() == moved(p_bytes, P_BLOCKS, d_before, D_BLOCKS)
        assert pair.p.notifier.messages(WriteDone) == [write_done()]


def test_duplicate_write_done_reports_once():
    with Pair(WRITE) as pair:
        pair.d.engine.add_recv(write_recv())
        pair.pump_until(lambda: pair.d.notifier.delivered, sides=(pair.d,))
        for _ in range(2):
            pair.d.engine.on_message(P_IDENTITY, write_done(ok=False, error="prefill failed"))
        pair.pump_until(lambda: "req-d" in pair.d.recving, sides=(pair.d,))
        pair.d.recving.clear()
        pair.pump_for(0.05, sides=(pair.d,))
        assert pair.d.recving == set(), "reported twice"
        assert (pair.d.engine.stats.num_failed, pair.d.engine.stats.num_completed) == (1, 0)


def test_duplicate_read_done_is_confirmed_once():
    with Pair(READ) as pair:
        hold(pair.p)
        pair.p.finished_req_ids.add("req-p")
        message = ReadDone("t1", list(P_BLOCKS), read_recv().prompt_hash, D_ADDRESS.host, D_ADDRESS.notify_port)
        pair.p.engine.on_message(D_IDENTITY, message)
        pair.p.engine.on_message(D_IDENTITY, message)
        pair.pump_until(lambda: len(pair.p.notifier.messages(ReadAck)) == 2, sides=(pair.p,))
        assert [a.ok for a in pair.p.notifier.messages(ReadAck)] == [True, False]
        assert pair.p.sending == {"req-p"} and pair.p.engine.stats.num_completed == 1


def test_release_overtaking_the_announcement_stops_p_before_any_write():
    """D's Release and its RemoteBlocks travel on separate connections: the Release can arrive
    first. P stops, says so, and the late announcement writes nothing."""
    with Pair(WRITE) as pair:
        d_before = pair.d.snapshot()
        pair.d.notifier.drop = True
        pair.d.engine.add_recv(write_recv())
        pair.pump_until(lambda: pair.d.notifier.messages(RemoteBlocks), sides=(pair.d,))
        pair.d.notifier.drop = False
        pair.p.engine.on_message(D_IDENTITY, Release("t1"))
        pair.p.engine.on_message(D_IDENTITY, remote_blocks())
        send(pair.p)
        pair.p.finished_req_ids.add("req-p")
        pair.pump_until(lambda: "req-d" in pair.d.recving and "req-p" in pair.p.sending)
        [done] = pair.p.notifier.messages(WriteDone)
        assert not done.ok and "released" in done.error
        assert pair.d.failed_recving == {"req-d"}
        assert pair.d.snapshot() == d_before


def test_write_done_before_d_bound_its_transfer_is_applied_after_binding():
    """P cancelled (WriteDone ok=False) before D's handshake with P even finished: D holds the
    message until it knows P's incarnation, then fails; P never writes."""
    with Pair(WRITE) as pair:
        d_before = pair.d.snapshot()
        pair.p.handshake_delay_s = 0.2  # D's handshake with P is slow
        pair.d.engine.add_recv(write_recv())
        pair.p.engine.cancel(CancelSpec("t1", D_ADDRESS, "prefill ended before its KV was complete"))
        pair.pump_until(lambda: pair.p.notifier.delivered, sides=(pair.p,))
        pair.pump_until(lambda: "req-d" in pair.d.recving)
        pair.pump_for(0.05)
        assert pair.d.failed_recving == {"req-d"}
        assert pair.d.snapshot() == d_before
        assert not pair.p.engine.has_active() and not pair.d.engine.has_active()


def test_messages_from_an_unknown_sender_never_start_or_decide_a_transfer():
    with Pair(WRITE) as pair:
        d_before = pair.d.snapshot()
        pair.d.engine.add_recv(write_recv())
        pair.pump_until(lambda: pair.d.notifier.delivered, sides=(pair.d,))
        pair.d.engine.on_message("127.0.0.1:6301/intruder", write_done())
        pair.d.engine.on_message("127.0.0.1:6301/intruder", write_done(ok=False, error="forged"))
        pair.pump_for(0.05, sides=(pair.d,))
        assert pair.d.recving == set()
        pair.p.engine.on_message("127.0.0.1:6302/intruder", remote_blocks(transfer_id="t9", blocks=(0, 1, 2, 3)))
        send(pair.p, request_id="req-p9", transfer_id="t9")
        pair.p.finished_req_ids.add("req-p9")
        pair.pump_until(lambda: "req-p9" in pair.p.sending, sides=(pair.p,))
        assert pair.p.engine.stats.num_fenced == 1, "P wrote for an incarnation that does not listen at D's address"
        assert pair.d.snapshot() == d_before
