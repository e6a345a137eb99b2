"""Every wait has a deadline: P never holds blocks forever, D never waits forever."""

from __future__ import annotations

import time

from pdserve.config import TransferMode
from pdserve.control.messages import Release, RemoteBlocks, WriteDone
from pdserve.transfer.specs import HoldSpec, RecvSpec, SendSpec
from tests.unit.connector.harness import D_ADDRESS, D_IDENTITY, NUM_LAYERS, P_ADDRESS, P_IDENTITY, PROMPT_HASH, Pair

WRITE, READ = TransferMode.WRITE, TransferMode.READ
TICK = 0.1  # every timeout in this file; bounds below allow generous scheduling slack


def write_recv(pair: Pair) -> None:
    pair.d.engine.add_recv(RecvSpec("req-d", "t1", WRITE, P_ADDRESS, (3, 4, 5, 6), 1, None, None, PROMPT_HASH))


def read_recv() -> RecvSpec:
    return RecvSpec("req-d", "t1", READ, P_ADDRESS, (1, 2), 0, (3, 4), time.time() + 30, PROMPT_HASH)


def write_send(pair: Pair) -> None:
    pair.p.engine.begin_step()
    pair.p.engine.add_send(SendSpec("req-p", "t1", D_ADDRESS, (0, 1, 2, 3), PROMPT_HASH))
    for layer in range(NUM_LAYERS):
        pair.p.engine.layer_ready(layer)


def test_p_write_never_announced_fails_after_defer_timeout_frees_and_tells_d():
    with Pair(WRITE, p_timeouts={"defer_timeout": TICK}) as pair:
        pair.d.notifier.drop = True  # D's RemoteBlocks is lost
        write_recv(pair)
        start = time.monotonic()
        write_send(pair)
        pair.p.finished_req_ids.add("req-p")
        pair.pump_until(lambda: "req-p" in pair.p.sending and "req-d" in pair.d.recving)
        assert time.monotonic() - start >= TICK * 0.9
        [done] = pair.p.notifier.messages(WriteDone)
        assert not done.ok and "never announced" in done.error
        assert pair.d.failed_recving == {"req-d"}
        assert not pair.p.engine.has_active() and not pair.d.engine.has_active()


def test_p_write_without_a_handshake_fails_after_defer_timeout():
    with Pair(WRITE, p_timeouts={"defer_timeout": TICK}) as pair:
        pair.d.handshake_error = "no answer from 127.0.0.1:6302"
        write_recv(pair)
        write_send(pair)
        pair.p.finished_req_ids.add("req-p")
        pair.pump_until(lambda: "req-p" in pair.p.sending and "req-d" in pair.d.recving)
        assert pair.d.failed_recving == {"req-d"}
        [done] = pair.p.notifier.messages(WriteDone)
        assert not done.ok


def test_d_write_never_done_releases_then_fails_after_the_grace():
    with Pair(WRITE, d_timeouts={"transfer_timeout": TICK, "release_grace": TICK}) as pair:
        start = time.monotonic()
        write_recv(pair)  # P never prefills this request
        pair.pump_until(lambda: pair.d.notifier.messages(Release), sides=(pair.d,))
        released_after = time.monotonic() - start
        assert released_after >= TICK * 0.9
        assert pair.d.recving == set(), "failed before the grace for P's confirmation"
        pair.pump_until(lambda: "req-d" in pair.d.recving, sides=(pair.d,))
        assert time.monotonic() - start >= 2 * TICK * 0.9
        assert pair.d.failed_recving == {"req-d"}
        assert [m.transfer_id for m in pair.d.notifier.messages(Release)] == ["t1"]
        assert not pair.d.engine.has_active()


def test_d_write_that_gave_up_never_reports_success_even_if_p_says_ok():
    with Pair(WRITE, d_timeouts={"transfer_timeout": TICK, "release_grace": 5.0}) as pair:
        write_recv(pair)
        pair.pump_until(lambda: pair.d.notifier.messages(Release), sides=(pair.d,))
        pair.d.engine.on_message(P_IDENTITY, WriteDone("t1", True, "", PROMPT_HASH))
        pair.pump_until(lambda: "req-d" in pair.d.recving, timeout_s=1.0, sides=(pair.d,))
        assert pair.d.failed_recving == {"req-d"}


def test_d_release_reaches_p_and_p_confirms_so_d_need_not_wait_the_grace():
    """D gave up while P had not started: P fails its send at once and confirms with WriteDone(ok=False)."""
    with Pair(WRITE, d_timeouts={"transfer_timeout": TICK, "release_grace": 30.0}) as pair:
        pair.d.notifier.drop = True
        write_recv(pair)  # RemoteBlocks lost
        pair.pump_until(lambda: pair.d.notifier.messages(Release), sides=(pair.d,))
        pair.p.engine.on_message(D_IDENTITY, Release("t1"))
        write_send(pair)  # P starts the request only now: the held Release applies at once
        pair.p.finished_req_ids.add("req-p")
        pair.pump_until(lambda: "req-d" in pair.d.recving and "req-p" in pair.p.sending, timeout_s=2.0)
        assert pair.d.failed_recving == {"req-d"}
        [done] = pair.p.notifier.messages(WriteDone)
        assert not done.ok


def test_p_read_hold_never_released_is_freed_at_expiry():
    with Pair(READ) as pair:
        start = time.monotonic()
        pair.p.engine.add_hold(HoldSpec("req-p", "t1", (0, 1), time.time() + TICK, PROMPT_HASH))
        pair.p.finished_req_ids.add("req-p")
        pair.pump(sides=(pair.p,))
        assert pair.p.sending == set()
        pair.pump_until(lambda: "req-p" in pair.p.sending, sides=(pair.p,))
        assert time.monotonic() - start >= TICK * 0.9
        assert not pair.p.engine.has_active()
        assert pair.p.notifier.sent == []


def test_d_read_handshake_failure_fails_at_once_and_addresses_nobody():
    """Every message is addressed to an incarnation: with no handshake there is none to release."""
    with Pair(READ) as pair:
        pair.p.handshake_error = "peer refused the handshake"
        pair.d.engine.add_recv(read_recv())
        elapsed = pair.pump_until(lambda: "req-d" in pair.d.recving, sides=(pair.d,))
        assert elapsed < 1.0
        assert pair.d.failed_recving == {"req-d"}
        assert pair.d.notifier.sent == []


def test_d_read_whose_handshake_never_answers_fails_at_transfer_timeout():
    with Pair(READ, d_timeouts={"transfer_timeout": TICK}) as pair:
        pair.p.handshake_delay_s = 3 * TICK  # P answers the handshake too late
        start = time.monotonic()
        pair.d.engine.add_recv(read_recv())
        pair.pump_until(lambda: "req-d" in pair.d.recving, sides=(pair.d,))
        assert TICK * 0.9 <= time.monotonic() - start < 3 * TICK
        assert pair.d.failed_recving == {"req-d"}
        # the Release waits for the late handshake: only then is there an incarnation to address
        pair.pump_until(lambda: pair.d.notifier.sent, sides=(pair.d,))
        assert [(type(s.message), s.message.transfer_id, s.recipient) for s in pair.d.notifier.sent] == [(Release, "t1", P_IDENTITY)]


def test_early_message_for_a_transfer_that_never_comes_is_dropped_after_defer_timeout():
    with Pair(WRITE, p_timeouts={"defer_timeout": TICK}) as pair:
        pair.p.engine.on_message(D_IDENTITY, RemoteBlocks("t1", [3, 4, 5, 6], 1, PROMPT_HASH, 5.0))
        pair.pump(sides=(pair.p,))
        time.sleep(TICK * 1.5)
        pair.pump(sides=(pair.p,))
        d_before = pair.d.snapshot()
        write_send(pair)  # too late: the announcement was dropped, so P times out instead of writing
        pair.p.finished_req_ids.add("req-p")
        pair.pump_until(lambda: "req-p" in pair.p.sending, sides=(pair.p,))
        [done] = pair.p.notifier.messages(WriteDone)
        assert not done.ok and "never announced" in done.error
        assert pair.d.snapshot() == d_before
