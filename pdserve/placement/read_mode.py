"""ReadPlacement: per-request placement decided on P, in READ mode.

vllm-router (READ mode) sends a request's prefill leg to P, waits for its answer, and only then
sends the decode leg to D with the kv_transfer_params of P's answer. D cannot decide before P
runs the prompt, so P decides, when the leg arrives (vLLM's `on_new_request`), with the policy D
uses in WRITE mode (policy.py): P's own queue, fresh, against D's side as D last published it
(`DecodeStatus`, status_view.py) plus the prompts P left to D that D had not taken in by then.

A prompt left to D is cut to one token (connector/scheduler/leg_truncation.py): P answers after a one-token step with
`placement: local:<reason>` and no blocks (params.py), and D prefills the prompt itself, in chunks.
vLLM admits waiting requests first come, first served, so a cut leg would wait behind P's whole
queue; instead, while a cut leg waits, prompts that would start their prefill are held back for one
scheduling pass (vLLM's "ask again next step"): cut legs ride in P's next step beside the chunks of
prompts already started (P's budget keeps room for them: launch/pd_modes.py). What that costs the cut
leg (P's next step) is added to its local estimate; a cut leg holds prompts back for HOLD_S at most.
Free of vLLM.
"""

from __future__ import annotations

import time
from collections import deque

from pdserve.control.address import PeerAddress
from pdserve.placement.decision import Decision, Placement, Reason
from pdserve.placement.messages import DecodeStatus, PrefillLoad
from pdserve.placement.policy import PlacementPolicy
from pdserve.placement.status_view import view_of

HOLD_S = 2.0  # a cut leg holds prompts back this long at most (it could not be admitted: no slot, no block)
IN_FLIGHT_S = 10.0  # a prompt left to D that D has not reported taking in after this long is forgotten


def peer_key(host: str, handshake_port: int) -> str:
    """How a DecodeStatus names a prefill instance."""
    return f"{host}:{handshake_port}"


def next_step_seconds(load: PrefillLoad | None, started_tokens: int) -> float:
    """P's next step, the one a cut leg rides in: its overhead and the next chunks of the prompts
    already started (`started_tokens` of them left)."""
    if load is None:
        return 0.0
    return load.overhead_s + load.per_token_s * min(started_tokens, load.budget)


class ReadPlacement:
    def __init__(self, policy: PlacementPolicy, own_key: str, clock=time.monotonic):
        self._policy = policy
        self._own_key = own_key  # this P, as D names it in DecodeStatus.placed_local
        self._clock = clock
        self._statuses: dict[tuple[str, int], DecodeStatus] = {}
        self._left: dict[tuple[str, int], deque[tuple[int, int, float]]] = {}  # D -> (seq, tokens, when)
        self._num_left: dict[tuple[str, int], int] = {}  # prompts left to each D so far
        self._decisions: dict[str, Decision] = {}
        self._cut_waiting: dict[str, float] = {}  # cut legs vLLM has not admitted yet -> since
        self._holding = False  # this scheduling pass held a prompt back

    def on_statuses(self, statuses: dict[tuple[str, int], DecodeStatus]) -> None:
        for key, status in statuses.items():
            taken = status.placed_local.get(self._own_key, 0)
            before = self._statuses.get(key)
            if before is None or taken < before.placed_local.get(self._own_key, 0):
                # the first word from this D (P may be a new incarnation D counted before), or a
                # restarted D (its count started over): number what we leave it from its count on
                self._num_left[key] = taken
                self._left.pop(key, None)
            self._statuses[key] = status

    def decide(self, tokens: int, peer: PeerAddress, load: PrefillLoad | None, local_delay_s: float) -> Decision:
        """Where a leg's prompt of `tokens` uncached tokens is prefilled, `peer` its decode instance."""
        key = (peer.host, peer.handshake_port)
        status = self._statuses.get(key)
        if status is None:
            return Decision(Placement.REMOTE, Reason.WARMING_UP)
        view = view_of(status, self._on_the_way(key, status))
        return self._policy.decide(tokens, view, load, local_delay_s)

    def placed(self, request_id: str, peer: PeerAddress, decision: Decision, tokens: int) -> None:
        """The decision that took effect (a local one only once its leg was cut)."""
        self._decisions[request_id] = decision
        if decision.placement is Placement.LOCAL:
            key = (peer.host, peer.handshake_port)
            self._num_left[key] = self._num_left.get(key, 0) + 1
            self._left.setdefault(key, deque()).append((self._num_left[key], tokens, self._clock()))
            self._cut_waiting[request_id] = self._clock()

    def admit(self, request_id: str) -> bool:
        """Whether a waiting request may start in this scheduling pass: a cut leg always; any other
        not while a cut leg waits, nor once one was held back in this pass (first come, first served)."""
        if request_id in self._cut_waiting:
            return True
        now = self._clock()
        for rid, since in list(self._cut_waiting.items()):
            if now - since > HOLD_S:
                del self._cut_waiting[rid]
        if self._cut_waiting:
            self._holding = True
        return not self._holding

    def admitted(self, request_id: str) -> None:
        self._cut_waiting.pop(request_id, None)

    def end_pass(self) -> None:
        self._holding = False

    def finished(self, request_id: str) -> Decision | None:
        self._cut_waiting.pop(request_id, None)
        return self._decisions.pop(request_id, None)

    def _on_the_way(self, key: tuple[str, int], status: DecodeStatus) -> int:
        """Tokens of the prompts left to D that D had not taken in when it measured `status`."""
        left = self._left.get(key)
        if not left:
            return 0
        taken = status.placed_local.get(self._own_key, 0)
        now = self._clock()
        while left and (left[0][0] <= taken or now - left[0][2] > IN_FLIGHT_S):
            left.popleft()
        return sum(tokens for _, tokens, _ in left)
