"""A request leg on this instance, as the scheduler half follows it: one `Leg` per request, with a
status whose every transition is listed here; an illegal one raises with the expected and actual
status. Free of vLLM.

A decode leg (D):

    NEW --(blocks allocated, KV to come)--> RECEIVING --(worker: over)--> RECEIVED
    NEW --(params malformed: RecvSpec fails it, P told)--> REJECTED --(worker: over)--> RECEIVED
    NEW --(D computes it, P told)--> RELEASED
    NEW --(D computes it after its other local prompts, P told)--> AWAITING_TURN --(its turn)--> RELEASED

A prefill leg on P that sends its KV (WRITE) or holds it for D to read (READ):

    PREFILLING --(the step computing its last prompt chunk)--> SENDING --(request ends)--> HELD
    PREFILLING --(no send possible, or the request ends first; D told)--> CANCELLED
    SENDING --(preempted: blocks freed, send stopped, D told)--> PREEMPTED --(request ends)--> HELD
    NEW --(READ: request ends with its prompt computed; HoldSpec)--> HELD

HELD ends when the worker reports the send or hold over (vLLM frees the blocks then).
Every status ends in `request_finished`, which tells P whatever it still needs to know (a transfer
that will not happen) and forgets the leg.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from pdserve.errors import PDServeError, ProtocolError
from pdserve.params import TransferParams
from pdserve.placement import Decision


class LegStatus(enum.Enum):
    NEW = "new"  # D: its KV is wanted; nothing planned yet
    RECEIVING = "receiving"  # D: RecvSpec planned
    REJECTED = "rejected"  # D: a RecvSpec that fails the request planned, P told
    RECEIVED = "received"  # D: the worker reported the transfer over
    AWAITING_TURN = "awaiting_turn"  # D: computes the prompt itself after its other local ones; P told
    RELEASED = "released"  # D: computes the prompt itself; P told, or P holds nothing
    PREFILLING = "prefilling"  # P, WRITE: its send is due in the step that computes its last prompt chunk
    SENDING = "sending"  # P, WRITE: SendSpec planned
    PREEMPTED = "preempted"  # P, WRITE: its send stopped by a preemption; never a second one
    HELD = "held"  # P: ended; its blocks stay until the worker reports the send or hold over
    CANCELLED = "cancelled"  # P: its transfer will not happen; D told


_NEXT: dict[LegStatus, frozenset[LegStatus]] = {
    LegStatus.NEW: frozenset({LegStatus.RECEIVING, LegStatus.REJECTED, LegStatus.RELEASED, LegStatus.AWAITING_TURN,
                              LegStatus.HELD}),
    LegStatus.RECEIVING: frozenset({LegStatus.RECEIVED}),
    LegStatus.REJECTED: frozenset({LegStatus.RECEIVED}),
    LegStatus.AWAITING_TURN: frozenset({LegStatus.RELEASED}),
    LegStatus.RECEIVED: frozenset(),
    LegStatus.RELEASED: frozenset(),
    LegStatus.PREFILLING: frozenset({LegStatus.SENDING, LegStatus.CANCELLED}),
    LegStatus.SENDING: frozenset({LegStatus.PREEMPTED, LegStatus.HELD}),
    LegStatus.PREEMPTED: frozenset({LegStatus.HELD}),
    LegStatus.HELD: frozenset(),
    LegStatus.CANCELLED: frozenset(),
}


class IllegalTransition(PDServeError):
    """A hook moved a leg along a transition its status does not have: a bug of ours, or vLLM
    calling hooks in an order we did not expect."""

    def __init__(self, request_id: str, expected: frozenset[LegStatus], actual: LegStatus, to: LegStatus):
        names = ", ".join(sorted(s.value for s in expected)) or "none (final)"
        super().__init__(f"leg {request_id}: cannot go to {to.value} from {actual.value} (expected one of: {names})")
        self.expected, self.actual, self.to = expected, actual, to


@dataclass
class Leg:
    """One request leg: its vLLM request, its parsed kv_transfer_params (or why they do not parse),
    its status, and the placement decision that takes effect when its blocks are allocated."""

    request: Any
    params: TransferParams | None
    error: ProtocolError | None = None
    rejected: TransferParams | None = None  # READ: params that parsed but do not fit the request
    status: LegStatus = LegStatus.NEW
    decision: Decision | None = None

    @property
    def request_id(self) -> str:
        return self.request.request_id

    def to(self, status: LegStatus) -> None:
        allowed = _NEXT[self.status]
        if status not in allowed:
            raise IllegalTransition(self.request_id, allowed, self.status, status)
        self.status = status

    @property
    def told_peer(self) -> TransferParams | None:
        """The params under which the peer holds or sends this leg's KV (None: nothing to tell it)."""
        return self.params if self.params is not None else self.rejected
