"""Fencing by incarnation: a transfer is bound to one peer process; a restart at the same address
or the death of that process never lets a message, a mapping or a copy of one incarnation touch
another's transfer or memory. Real bytes through ShmTransport; restarts via `Pair.restart`."""

from __future__ import annotations

from pdserve.control.messages import ReadAck, ReadDone, Release, WriteDone
from tests.unit.connector.harness import D_IDENTITY, P_IDENTITY, Pair
from tests.unit.transfer.transfers import (
    D_BLOCKS,
    P_BLOCKS,
    READ,
    WRITE,
    hold,
    moved,
    read_recv,
    send,
    write_recv,
)

NEW_P = "127.0.0.1:6301/p-restarted"
NEW_D = "127.0.0.1:6302/d-restarted"


def complete_read(pair: Pair, transfer_id: str, request_id: str) -> None:
    """One READ transfer end to end, so D has P's current incarnation mapped."""
    hold(pair.p, request_id=f"{request_id}-p", transfer_id=transfer_id)
    pair.d.engine.add_recv(read_recv(request_id, transfer_id))
    pair.pump_until(lambda: request_id in pair.d.recving)
    assert request_id not in pair.d.failed_recving


def test_read_after_p_restarted_never_confirms_the_old_p_mapping():
    """Finding 1: D still maps the old P (its segment outlives it while mapped). The hold of t1
    lives in the new P: D may read the old mapping, but must never report that as success."""
    with Pair(READ, d_timeouts={"transfer_timeout": 0.4, "release_grace": 0.1}) as pair:
        complete_read(pair, "t0", "req-d0")
        old_p = pair.p
        new_p = pair.restart("p", NEW_P, seed=77)
        new_p_bytes = new_p.snapshot()
        hold(new_p, transfer_id="t1")
        pair.d.engine.add_recv(read_recv("req-d1", "t1"))
        pair.pump_until(lambda: "req-d1" in pair.d.recving, sides=(pair.d, new_p))
        assert pair.d.failed_recving == {"req-d1"}, "D reported success for bytes the new P never confirmed"
        assert new_p.notifier.messages(ReadAck) == [], "the new P confirmed a read of the old P's memory"
        assert all(s.recipient == P_IDENTITY for s in pair.d.notifier.sent if s.message.transfer_id == "t1")
        assert new_p.snapshot() == new_p_bytes
        assert new_p.engine.has_active(), "the new P's hold is untouched (it frees at its own deadline)"
        assert old_p.engine.stats.num_completed == 1


def test_read_after_p_died_and_restarted_reads_and_confirms_the_new_p(live_process):
    """Finding 1, when the old P is provably gone (same host, pid dead): D drops its mapping,
    handshakes the new incarnation and reads exactly the new P's held blocks."""
    with Pair(READ) as pair:
        pair.p.liveness = live_process.start()
        complete_read(pair, "t0", "req-d0")
        d_before = pair.d.snapshot()
        live_process.kill(pair.p.liveness)
        new_p = pair.restart("p", NEW_P, seed=77)
        hold(new_p, transfer_id="t1")
        new_p.finished_req_ids.add("req-p")
        pair.d.engine.add_recv(read_recv("req-d1", "t1"))
        pair.pump_until(lambda: "req-d1" in pair.d.recving and "req-p" in new_p.sending)
        assert pair.d.failed_recving == set()
        assert pair.d.snapshot() == moved(new_p.snapshot(), P_BLOCKS, d_before, D_BLOCKS)
        assert [s.recipient for s in pair.d.notifier.sent if isinstance(s.message, ReadDone)][-1] == NEW_P
        assert new_p.notifier.messages(ReadAck) == [ReadAck("t1", True, "")]


def test_write_announced_by_the_old_d_is_never_written_into_the_new_d():
    """Finding 2: old D announced its blocks, then D restarted at the same address before P wrote.
    P binds t1 to the old D; a handshake finds the new D there; P must fence the transfer."""
    with Pair(WRITE) as pair:
        old_d = pair.d
        old_d.engine.add_recv(write_recv())
        pair.pump_until(lambda: old_d.notifier.delivered, sides=(old_d,))  # RemoteBlocks reached P
        new_d = pair.restart("d", NEW_D, seed=99)
        new_d_before = new_d.snapshot()
        send(pair.p)
        pair.p.finished_req_ids.add("req-p")
        pair.pump_until(lambda: "req-p" in pair.p.sending, sides=(pair.p, new_d))
        assert new_d.snapshot() == new_d_before, "P wrote the old D's announcement into the new D's blocks"
        assert not [s for s in pair.p.notifier.delivered if isinstance(s.message, WriteDone)], \
            "a WriteDone for the old D reached the new D"
        assert pair.p.engine.stats.num_fenced == 1 and pair.p.engine.stats.num_completed == 0
        assert (new_d.recving, new_d.failed_recving) == (set(), set())


def test_write_to_a_d_that_restarted_while_mapped_touches_only_the_old_memory():
    """Finding 2, with the old D already mapped by P (an earlier transfer): P may finish into the
    old D's memory, but the new D's bytes and reports stay untouched."""
    with Pair(WRITE) as pair:
        pair.d.engine.add_recv(write_recv("req-d0", "t0"))
        send(pair.p, "req-p0", "t0")
        pair.pump_until(lambda: "req-d0" in pair.d.recving)
        old_d = pair.d
        old_d.engine.add_recv(write_recv())
        pair.pump_until(lambda: len(old_d.notifier.delivered) == 2, sides=(old_d,))  # t1 announced
        new_d = pair.restart("d", NEW_D, seed=99)
        new_d_before = new_d.snapshot()
        send(pair.p)
        pair.p.finished_req_ids.add("req-p")
        pair.pump_until(lambda: "req-p" in pair.p.sending, sides=(pair.p, new_d))
        assert new_d.snapshot() == new_d_before
        assert all(s.recipient == D_IDENTITY for s in pair.p.notifier.sent)
        assert not [s for s in pair.p.notifier.delivered if s.message.transfer_id == "t1"]


def test_write_for_the_new_d_ignores_the_old_d_and_never_lands_its_bytes():
    """Finding 2, both incarnations announce t1 (the router retried on the new D): P bound t1 to
    the first announcer, the old D; the new D's blocks stay untouched and it never succeeds."""
    with Pair(WRITE, d_timeouts={"transfer_timeout": 0.3, "release_grace": 0.1}) as pair:
        old_d = pair.d
        old_d.engine.add_recv(write_recv())
        pair.pump_until(lambda: old_d.notifier.delivered, sides=(old_d,))
        new_d = pair.restart("d", NEW_D, seed=99)
        new_d_before = new_d.snapshot()
        new_d.engine.add_recv(write_recv(blocks=(0, 1, 2, 3)))
        pair.pump_until(lambda: new_d.notifier.delivered, sides=(new_d,))
        send(pair.p)
        pair.pump_until(lambda: "req-d" in new_d.recving, sides=(pair.p, new_d))
        assert new_d.failed_recving == {"req-d"}
        assert new_d.snapshot() == new_d_before


def test_read_ack_for_another_transfer_or_from_another_sender_is_ignored():
    """Finding 13: only P's incarnation that D read from can confirm (or refuse) D's read."""
    with Pair(READ, p_timeouts={"defer_timeout": 3.0}) as pair:
        pair.d.engine.add_recv(read_recv())
        pair.pump_until(lambda: pair.d.notifier.messages(ReadDone), sides=(pair.d,))  # P holds nothing yet
        pair.pump(sides=(pair.p,))
        for sender, ack in [("127.0.0.1:6301/intruder", ReadAck("t1", True, "")),
                            ("127.0.0.1:6301/intruder", ReadAck("t1", False, "forged refusal")),
                            (P_IDENTITY, ReadAck("t2", True, "")),
                            (P_IDENTITY, ReadAck("t2", False, "other transfer"))]:
            pair.d.engine.on_message(sender, ack)
        pair.pump_for(0.1, sides=(pair.d,))
        assert (pair.d.recving, pair.d.engine.stats.num_completed) == (set(), 0), \
            "a ReadAck not from P's incarnation, or for another transfer, decided t1"
        p_bytes, d_before = pair.p.snapshot(), pair.d.snapshot()
        hold(pair.p)
        pair.pump_until(lambda: "req-d" in pair.d.recving)
        assert pair.d.failed_recving == set()
        assert pair.d.snapshot() == d_before == moved(p_bytes, P_BLOCKS, d_before, D_BLOCKS)


def test_read_ack_before_d_read_anything_does_not_confirm_it():
    """A ReadAck(ok) from the right incarnation that no ReadDone asked for (a stale or replayed
    answer) arrives before D read: D must wait for the answer to its own ReadDone."""
    with Pair(READ, p_timeouts={"defer_timeout": 0.3}) as pair:
        pair.d.engine.on_message(P_IDENTITY, ReadAck("t1", True, ""))
        pair.d.engine.add_recv(read_recv())  # P holds nothing: it refuses after defer_timeout
        pair.pump_until(lambda: "req-d" in pair.d.recving)
        assert pair.d.failed_recving == {"req-d"}
        assert [m.transfer_id for m in pair.d.notifier.messages(Release)] == ["t1"]


def test_d_write_fails_at_once_when_p_dies(live_process):
    """P provably dead (same host, pid gone): nothing of it can copy any more, so D fails its
    transfer at the next liveness check, without waiting for its deadline or the fence."""
    with Pair(WRITE, d_timeouts={"transfer_timeout": 5.0, "release_grace": 5.0}) as pair:
        pair.p.liveness = live_process.start()
        pair.d.engine.add_recv(write_recv())
        pair.pump_until(lambda: pair.d.notifier.delivered, sides=(pair.d,))
        live_process.kill(pair.p.liveness)
        elapsed = pair.pump_until(lambda: "req-d" in pair.d.recving, sides=(pair.d,))
        assert elapsed < 1.5
        assert pair.d.failed_recving == {"req-d"}
        assert pair.d.engine.stats.num_fenced == 1
        assert pair.d.engine.num_peers == 0
        assert pair.d.notifier.forgotten[-1:] == [pair.d.notifier.sent[0].address]


def test_d_read_fails_at_once_when_p_dies_while_confirming(live_process):
    with Pair(READ, p_timeouts={"defer_timeout": 5.0}, d_timeouts={"transfer_timeout": 5.0}) as pair:
        pair.p.liveness = live_process.start()
        pair.d.engine.add_recv(read_recv())  # P holds nothing: D waits for its answer
        pair.pump_until(lambda: pair.d.notifier.messages(ReadDone), sides=(pair.d,))
        live_process.kill(pair.p.liveness)
        elapsed = pair.pump_until(lambda: "req-d" in pair.d.recving, sides=(pair.d,))
        assert elapsed < 1.5
        assert pair.d.failed_recving == {"req-d"}
        assert pair.d.engine.stats.num_fenced == 1


def test_p_write_fails_at_once_when_d_dies(live_process):
    with Pair(WRITE) as pair:
        pair.d.liveness = live_process.start()
        pair.d.engine.add_recv(write_recv())
        pair.pump_until(lambda: pair.d.notifier.delivered, sides=(pair.d,))
        send(pair.p, layers=[0])  # layer 1 never computed: P is waiting on its forward pass
        pair.pump_until(lambda: pair.p.engine.num_peers == 1, sides=(pair.p,))
        live_process.kill(pair.d.liveness)
        pair.p.finished_req_ids.add("req-p")
        elapsed = pair.pump_until(lambda: "req-p" in pair.p.sending, sides=(pair.p,))
        assert elapsed < 1.5
        assert pair.p.engine.stats.num_fenced == 1
        assert not [m for m in pair.p.notifier.messages(WriteDone) if m.ok]


def test_p_with_a_stale_view_of_a_restarted_d_handshakes_again_and_writes_the_new_d():
    """P still maps the old D when the new D announces t1: one refresh handshake finds the new
    incarnation, P writes into the new D's blocks, never into the old D's."""
    with Pair(WRITE) as pair:
        pair.d.engine.add_recv(write_recv("req-d0", "t0"))
        send(pair.p, "req-p0", "t0")
        pair.pump_until(lambda: "req-d0" in pair.d.recving)
        old_d = pair.d
        old_before = old_d.snapshot()
        new_d = pair.restart("d", NEW_D, seed=99)
        p_bytes, new_before = pair.p.snapshot(), new_d.snapshot()
        new_d.engine.add_recv(write_recv())
        send(pair.p)
        pair.pump_until(lambda: "req-d" in new_d.recving)
        assert new_d.failed_recving == set()
        assert new_d.snapshot() == moved(p_bytes, P_BLOCKS, new_before, D_BLOCKS)
        assert old_d.snapshot() == old_before
        assert old_d.handshakes == 1 and new_d.handshakes == 1
        assert pair.p.engine.stats.num_fenced == 0


def test_p_that_finds_the_old_d_dead_while_writing_resumes_with_the_new_d(live_process):
    """P still maps the old D (a real process, now dead) when the new D announces t1 and P's
    layers are ready: P drops the dead incarnation, handshakes whoever listens there now, and
    writes the new D's blocks at once (not after a deadline)."""
    with Pair(WRITE) as pair:
        pair.d.liveness = live_process.start()
        pair.d.engine.add_recv(write_recv("req-d0", "t0"))
        send(pair.p, "req-p0", "t0")
        pair.pump_until(lambda: "req-d0" in pair.d.recving)
        live_process.kill(pair.d.liveness)
        new_d = pair.restart("d", NEW_D, seed=99)
        p_bytes, new_before = pair.p.snapshot(), new_d.snapshot()
        new_d.engine.add_recv(write_recv())
        pair.pump_until(lambda: new_d.notifier.delivered, sides=(new_d,))
        send(pair.p)
        elapsed = pair.pump_until(lambda: "req-d" in new_d.recving)
        assert elapsed < 1.0
        assert new_d.failed_recving == set()
        assert new_d.snapshot() == moved(p_bytes, P_BLOCKS, new_before, D_BLOCKS)


def test_d_giving_up_on_a_transfer_p_never_had_is_answered_at_once_and_fences_it():
    """D timed out on t1, which P never saw (a forged id, or P's leg still queued): P answers the
    Release with WriteDone(False) at once, so D recomputes without waiting for the fence, and a
    send for t1 that reaches P later never writes D's blocks."""
    with Pair(WRITE, d_timeouts={"transfer_timeout": 0.3}) as pair:
        d_before = pair.d.snapshot()
        pair.d.engine.add_recv(write_recv())
        elapsed = pair.pump_until(lambda: "req-d" in pair.d.recving)
        assert pair.d.failed_recving == {"req-d"}
        assert elapsed < 0.3 + 0.5, f"D waited {elapsed:.2f} s: P's answer should end the wait, not the fence"
        assert [m.ok for m in pair.p.notifier.messages(WriteDone)] == [False]
        send(pair.p)
        pair.p.finished_req_ids.add("req-p")
        pair.pump_until(lambda: "req-p" in pair.p.sending, sides=(pair.p,))
        assert pair.d.snapshot() == d_before, "P wrote blocks of a transfer D had already given up"
