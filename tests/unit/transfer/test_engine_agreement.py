"""Finding 5: both legs must name the same prompt (digest) and the same number of blocks, in
both modes; a disagreement fails the transfer on both sides and never delivers KV as success."""

from __future__ import annotations

import pytest

from pdserve.control.messages import ReadAck, Release, WriteDone
from tests.unit.connector.harness import OTHER_PROMPT_HASH, P_IDENTITY, PROMPT_HASH, Pair
from tests.unit.transfer.transfers import (
    D_BLOCKS,
    P_BLOCKS,
    READ,
    WRITE,
    hold,
    read_recv,
    send,
    write_done,
    write_recv,
)


def assert_failed_on_both_sides(pair: Pair) -> None:
    assert pair.d.failed_recving == {"req-d"}
    assert (pair.d.engine.stats.num_completed, pair.p.engine.stats.num_completed) == (0, 0)
    assert not pair.p.engine.has_active() and not pair.d.engine.has_active()


@pytest.mark.parametrize("d_blocks, p_blocks", [(D_BLOCKS[:3], P_BLOCKS), (D_BLOCKS, P_BLOCKS[:3])])
def test_write_block_count_mismatch_fails_both_sides_and_writes_nothing(d_blocks, p_blocks):
    with Pair(WRITE) as pair:
        d_before = pair.d.snapshot()
        pair.d.engine.add_recv(write_recv(blocks=d_blocks))
        send(pair.p, blocks=p_blocks)
        pair.p.finished_req_ids.add("req-p")
        pair.pump_until(lambda: "req-d" in pair.d.recving and "req-p" in pair.p.sending)
        [done] = pair.p.notifier.messages(WriteDone)
        assert not done.ok and "block counts differ" in done.error
        assert pair.d.snapshot() == d_before
        assert_failed_on_both_sides(pair)


def test_write_prompt_digest_mismatch_fails_both_sides_and_writes_nothing():
    with Pair(WRITE) as pair:
        d_before = pair.d.snapshot()
        pair.d.engine.add_recv(write_recv(prompt_hash=OTHER_PROMPT_HASH))
        send(pair.p)
        pair.p.finished_req_ids.add("req-p")
        pair.pump_until(lambda: "req-d" in pair.d.recving and "req-p" in pair.p.sending)
        [done] = pair.p.notifier.messages(WriteDone)
        assert not done.ok and "prompt digests differ" in done.error
        assert pair.d.snapshot() == d_before
        assert_failed_on_both_sides(pair)


def test_write_done_ok_for_another_prompt_is_a_failure():
    """P says it wrote t1, but for another prompt than D's: D must not use those blocks."""
    with Pair(WRITE) as pair:
        pair.d.engine.add_recv(write_recv())
        pair.pump_until(lambda: pair.d.notifier.delivered, sides=(pair.d,))
        pair.d.engine.on_message(P_IDENTITY, write_done(prompt_hash=OTHER_PROMPT_HASH))
        pair.pump_until(lambda: "req-d" in pair.d.recving, sides=(pair.d,))
        assert pair.d.failed_recving == {"req-d"}
        assert pair.d.engine.stats.num_completed == 0


@pytest.mark.parametrize("remote", [P_BLOCKS[:3], P_BLOCKS + (4,)])
def test_read_block_count_mismatch_fails_before_reading(remote):
    with Pair(READ) as pair:
        hold(pair.p)
        pair.p.finished_req_ids.add("req-p")
        d_before = pair.d.snapshot()
        pair.d.engine.add_recv(read_recv(remote=remote))
        pair.pump_until(lambda: "req-d" in pair.d.recving and "req-p" in pair.p.sending)
        assert pair.d.snapshot() == d_before, "D read blocks of a transfer whose block counts differ"
        assert [m.transfer_id for m in pair.d.notifier.messages(Release)] == ["t1"]
        assert pair.p.notifier.messages(ReadAck) == []
        assert_failed_on_both_sides(pair)


def test_read_of_a_hold_with_another_block_count_is_refused_by_p():
    """D's own lists agree, P's hold does not: P refuses the ReadDone, D fails and releases."""
    with Pair(READ) as pair:
        hold(pair.p, blocks=P_BLOCKS[:3])
        pair.p.finished_req_ids.add("req-p")
        pair.d.engine.add_recv(read_recv())
        pair.pump_until(lambda: "req-d" in pair.d.recving and "req-p" in pair.p.sending)
        [ack] = pair.p.notifier.messages(ReadAck)
        assert not ack.ok and "holds blocks" in ack.error
        assert [m.transfer_id for m in pair.d.notifier.messages(Release)] == ["t1"]
        assert_failed_on_both_sides(pair)


@pytest.mark.parametrize("p_hash, d_hash", [(OTHER_PROMPT_HASH, PROMPT_HASH), (PROMPT_HASH, OTHER_PROMPT_HASH)])
def test_read_prompt_digest_mismatch_is_refused_by_p_and_fails_d(p_hash, d_hash):
    with Pair(READ) as pair:
        hold(pair.p, prompt_hash=p_hash)
        pair.p.finished_req_ids.add("req-p")
        pair.d.engine.add_recv(read_recv(prompt_hash=d_hash))
        pair.pump_until(lambda: "req-d" in pair.d.recving and "req-p" in pair.p.sending)
        [ack] = pair.p.notifier.messages(ReadAck)
        assert not ack.ok and "different prompt" in ack.error
        assert [m.transfer_id for m in pair.d.notifier.messages(Release)] == ["t1"]
        assert_failed_on_both_sides(pair)
