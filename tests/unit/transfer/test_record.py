"""Transfer: one object per request leg; illegal transitions fail loudly."""

from __future__ import annotations

import pytest

from pdserve.config import TransferMode
from pdserve.errors import PDServeError
from pdserve.transfer.record import IllegalTransition, Side, Transfer, TransferState, WriteWindow


def make(first_block=0, remote=(10, 11, 12)) -> Transfer:
    return Transfer("t1", "req", Side.SEND, TransferMode.WRITE, None, (1, 2, 3), deadline=0.0,
                    remote_block_ids=remote, first_block=first_block)


def test_happy_life_waiting_copying_done():
    t = make()
    assert t.state is TransferState.WAITING and not t.state.is_terminal
    t.start_copying()
    t.start_copying()  # more layers, same state
    t.succeed()
    assert t.state is TransferState.DONE and t.state.is_terminal and t.seconds >= 0


@pytest.mark.parametrize("setup", ["waiting", "copying"])
def test_fail_from_any_live_state_records_the_reason(setup):
    t = make()
    if setup == "copying":
        t.start_copying()
    t.fail("boom")
    assert (t.state, t.error) == (TransferState.FAILED, "boom")


@pytest.mark.parametrize(
    "first, then, names",
    [
        ("succeed", "fail", ("done", "failed")),
        ("succeed", "succeed", ("done", "done")),
        ("fail", "succeed", ("failed", "done")),
        ("fail", "fail", ("failed", "failed")),
        ("succeed", "start_copying", ("done", "copying")),
        ("fail", "start_copying", ("failed", "copying")),
    ],
)
def test_terminal_states_never_move_and_the_error_names_both_states(first, then, names):
    t = make()
    getattr(t, first)(*(["x"] if first == "fail" else []))
    before = (t.state, t.error)
    with pytest.raises(IllegalTransition) as info:
        getattr(t, then)(*(["y"] if then == "fail" else []))
    message = str(info.value)
    assert names[0] in message and names[1] in message and "t1" in message
    assert (t.state, t.error) == before
    assert isinstance(info.value, PDServeError)


def test_block_pairs_start_at_first_block():
    assert make().group_pairs() == [[(1, 10), (2, 11), (3, 12)]]
    assert make(first_block=1).group_pairs() == [[(2, 11), (3, 12)]]
    assert make(first_block=3).group_pairs() == [[]]


@pytest.mark.parametrize("remote", [(10, 11), (10, 11, 12, 13), None])
def test_block_pairs_refuse_lists_of_different_lengths(remote):
    """Both legs must name the same number of blocks: a shorter or longer list is another prompt."""
    with pytest.raises(PDServeError, match="block counts differ"):
        make(remote=remote).group_pairs()


def test_each_leg_kind_names_its_phases():
    """D WRITE: ANNOUNCED; D READ: COPYING then CONFIRMING; P READ hold: WAITING to DONE."""
    write_recv = make()
    write_recv.announce(WriteWindow(announced_at=1.0, write_for=5.0))
    assert write_recv.state is TransferState.ANNOUNCED and write_recv.window.write_for == 5.0
    write_recv.succeed()
    read_recv = make()
    read_recv.start_copying()
    read_recv.confirm()
    assert read_recv.state is TransferState.CONFIRMING
    read_recv.succeed()
    hold = make()
    hold.succeed()
    assert all(t.state is TransferState.DONE for t in (write_recv, read_recv, hold))


@pytest.mark.parametrize("before", ["waiting", "announced", "copying", "confirming"])
def test_stopping_keeps_its_first_reason_and_may_only_fail(before):
    t = make()
    if before == "announced":
        t.announce(WriteWindow(1.0, 5.0))
    elif before in ("copying", "confirming"):
        t.start_copying()
        if before == "confirming":
            t.confirm()
    assert t.stop("first") and not t.stop("second")
    assert (t.state, t.error) == (TransferState.STOPPING, "first")
    for move in (t.succeed, t.start_copying, t.confirm):
        with pytest.raises(IllegalTransition, match="stopping -> "):
            move()
    t.fail(t.error)
    assert (t.state, t.error) == (TransferState.FAILED, "first")


@pytest.mark.parametrize(
    "setup, move, names",
    [
        ("announced", "start_copying", ("announced", "copying")),
        ("announced", "confirm", ("announced", "confirming")),
        ("waiting", "confirm", ("waiting", "confirming")),
        ("copying", "announce", ("copying", "announced")),
        ("confirming", "start_copying", ("confirming", "copying")),
    ],
)
def test_phases_move_only_forward(setup, move, names):
    t = make()
    if setup == "announced":
        t.announce(WriteWindow(1.0, 5.0))
    elif setup in ("copying", "confirming"):
        t.start_copying()
        if setup == "confirming":
            t.confirm()
    with pytest.raises(IllegalTransition) as info:
        getattr(t, move)(*([WriteWindow(1.0, 5.0)] if move == "announce" else []))
    assert f"{names[0]} -> {names[1]}" in str(info.value)
    assert t.state.value == setup
