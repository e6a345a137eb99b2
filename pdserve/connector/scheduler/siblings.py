"""Siblings: the children vLLM makes of one request with `n > 1`, which share one transfer.

vLLM's API server splits a request with `n` choices into n requests `0_<id>` ... `<n-1>_<id>`
with the same prompt and the same `kv_transfer_params`, so on each instance the n legs of one
request name one transfer id. Their KV is the same: it moves once. The first leg of a transfer
seen on an instance leads it and does what a leg with n = 1 does; the others follow it:

* on P a follower moves nothing and is cut to one token where it can be (its answer is discarded
  like the leader's, except in READ mode, where it answers with the leader's kv_transfer_params:
  vLLM returns one child's, whichever ends last, so a follower ends after its leader);
* on D a follower waits until its leader's prompt is in D's cache (its KV landed, or D computed
  it), then takes it from vLLM's prefix cache and computes only the rest.

vLLM adds the children one by one, so a leader can end before a sibling is first seen (P: a prompt
in its prefix cache takes one step). A family whose legs all ended is kept for ENDED_KEEP_S, and a
sibling that arrives meanwhile follows it, its leader already done.

A follower must never cancel the transfer, which is its leader's. Free of vLLM.
"""

from __future__ import annotations

import re
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

_CHILD = re.compile(r"[0-9]+_(.+)", re.DOTALL)
ENDED_KEEP_S = 60.0  # how long a family whose legs all ended waits for a sibling vLLM adds late
MAX_ENDED = 1024  # ended families kept at most (the oldest go first)


def parent_id(request_id: str) -> str:
    """The id of the request vLLM split into `request_id` (the id itself for a request with n = 1)."""
    child = _CHILD.fullmatch(request_id)
    return child.group(1) if child else request_id


@dataclass
class Family:
    """The legs of one transfer on this instance; `leader` runs it."""

    leader: Any  # the vLLM request
    parent: str
    members: set[str] = field(default_factory=set)
    leader_done: bool = False  # the leader finished (ended or handed over)
    answer: dict[str, Any] | None = None  # P, READ: the kv_transfer_params the leader answered with

    @property
    def leader_id(self) -> str:
        return self.leader.request_id


class Siblings:
    """The families of this instance's live legs, by transfer id."""

    def __init__(self, clock=time.monotonic) -> None:
        self._families: dict[str, Family] = {}
        self._transfer_of: dict[str, str] = {}  # request id -> transfer id, for every member
        self._ended: OrderedDict[str, tuple[float, Family]] = OrderedDict()  # transfer id -> (ended at, family)
        self._clock = clock

    def join(self, request, transfer_id: str) -> Family | None:
        """Register `request` as a leg of `transfer_id` (again: a no-op); its family if it follows
        another leg, None if it leads (or is no sibling of the leg that leads: a reused transfer id)."""
        rid = request.request_id
        if rid in self._transfer_of:
            return self.follower(rid)
        family = self._families.get(transfer_id) or self._revive(transfer_id, parent_id(rid))
        if family is None:
            family = self._families[transfer_id] = Family(request, parent_id(rid))
        elif family.parent != parent_id(rid):
            return None
        family.members.add(rid)
        self._transfer_of[rid] = transfer_id
        return self.follower(rid)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._transfer_of

    def follower(self, request_id: str) -> Family | None:
        """The family `request_id` follows; None for a leader or a leg never joined."""
        family = self._families.get(self._transfer_of.get(request_id, ""))
        return family if family is not None and family.leader_id != request_id else None

    def leader_finished(self, request_id: str, answer: dict[str, Any] | None) -> None:
        """The leader `request_id` ended, answering with `answer` (P, READ)."""
        family = self._families.get(self._transfer_of.get(request_id, ""))
        if family is not None and family.leader_id == request_id:
            family.leader_done = True
            family.answer = answer

    def leave(self, request_id: str) -> None:
        transfer_id = self._transfer_of.pop(request_id, None)
        family = self._families.get(transfer_id) if transfer_id is not None else None
        if family is None:
            return
        family.members.discard(request_id)
        if family.leader_id == request_id:
            family.leader_done = True
        if not family.members:
            del self._families[transfer_id]
            self._ended[transfer_id] = (self._clock(), family)
            self._ended.move_to_end(transfer_id)
        self._expire()

    def _revive(self, transfer_id: str, parent: str) -> Family | None:
        """The ended family of `transfer_id` if `parent` split it, live again for a late sibling."""
        self._expire()
        ended = self._ended.get(transfer_id)
        if ended is None or ended[1].parent != parent:
            return None
        del self._ended[transfer_id]
        self._families[transfer_id] = ended[1]
        return ended[1]

    def _expire(self) -> None:
        now = self._clock()
        while self._ended and (len(self._ended) > MAX_ENDED or now - next(iter(self._ended.values()))[0] > ENDED_KEEP_S):
            self._ended.popitem(last=False)
