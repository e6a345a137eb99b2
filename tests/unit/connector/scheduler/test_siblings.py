"""Siblings: a late child follows its ended leader only while the family is kept."""

from __future__ import annotations

from types import SimpleNamespace

from pdserve.connector.scheduler.siblings import ENDED_KEEP_S, MAX_ENDED, Siblings


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def leg(request_id: str) -> SimpleNamespace:
    return SimpleNamespace(request_id=request_id)


def test_a_child_added_after_its_leader_ended_follows_it_with_the_leaders_answer():
    siblings = Siblings()
    assert siblings.join(leg("0_r"), "tx") is None
    siblings.leader_finished("0_r", {"remote_block_ids": [7]})
    siblings.leave("0_r")
    family = siblings.join(leg("1_r"), "tx")
    assert family is not None and family.leader_done and family.answer == {"remote_block_ids": [7]}


def test_an_ended_family_is_never_joined_by_another_requests_leg():
    siblings = Siblings()
    siblings.join(leg("0_r"), "tx")
    siblings.leave("0_r")
    assert siblings.join(leg("0_other"), "tx") is None, "another request's leg reusing the id leads"


def test_an_ended_family_is_forgotten_after_its_keep_time():
    clock = Clock()
    siblings = Siblings(clock)
    for parent in ("a", "b"):
        siblings.join(leg(f"0_{parent}"), f"tx-{parent}")
        siblings.leave(f"0_{parent}")
    clock.now = ENDED_KEEP_S - 1
    assert siblings.join(leg("1_a"), "tx-a") is not None
    clock.now = ENDED_KEEP_S + 1
    assert siblings.join(leg("1_b"), "tx-b") is None, "kept too long: the late leg leads"


def test_ended_families_kept_are_bounded():
    siblings = Siblings()
    for i in range(MAX_ENDED + 1):
        siblings.join(leg(f"0_r{i}"), f"tx{i}")
        siblings.leave(f"0_r{i}")
    assert siblings.join(leg("1_r0"), "tx0") is None, "the oldest ended family went first"
    assert siblings.join(leg(f"1_r{MAX_ENDED}"), f"tx{MAX_ENDED}") is not None
