"""PrefillPlacement: P's side of adaptive placement, between vLLM's hooks and pdserve/placement.

WRITE: D decides; a prefill leg waits at the gate (placement/prefill_gate.py) until D's word
arrives, and one D prefills itself is cut to a one-token prompt (leg_truncation.py). READ: P
decides when the leg arrives (placement/read_mode.py). Either way P publishes its queue of prompts
still to compute as a `PrefillLoad`, and with serve_decode its prompts take turns beside the streams
it decodes (whole_requests.py). With static placement every leg is prefilled here at once.

PrefillScheduler calls these on a producer; the legs' KV is moved by legs/prefill_send.py and
legs/prefill_hold.py.
"""

from __future__ import annotations

import time
from typing import Any, Callable

from pdserve.config import ConnectorConfig, Role, TransferMode
from pdserve.connector.metadata import StepPlan
from pdserve.connector.scheduler.leg_truncation import truncate_to_one_token
from pdserve.connector.scheduler.step_pacing import PrefillPacer
from pdserve.connector.scheduler.whole_requests import PromptTurns, addressed_to_self
from pdserve.errors import ProtocolError
from pdserve.params import parse_transfer_params
from pdserve.placement import (
    MAX_COUNTED_TRANSFERS,
    Decision,
    Placement,
    PlacementPolicy,
    PrefillGate,
    PrefillLoad,
    ReadPlacement,
    Reason,
    Verdict,
    WorkerNews,
    next_step_seconds,
    peer_key,
    uncomputed_prompt_tokens,
)
from pdserve.transfer.specs import AwaitSpec

NOT_YET = (None, False)  # get_num_new_matched_tokens: vLLM asks again next step
NOW = (0, False)  # get_num_new_matched_tokens: nothing external, schedule it


class PrefillPlacement:
    def __init__(self, config: ConnectorConfig, policy: PlacementPolicy, pacer: PrefillPacer,
                 plan: Callable[[], StepPlan]):
        self._config = config
        self._pacer = pacer  # P's step costs and prefill share, published in its load
        self._plan = plan  # the StepPlan being built
        adaptive, write = config.placement.adaptive, config.mode is TransferMode.WRITE
        self._gate = PrefillGate(config.placement.wait_s) if adaptive and write else None
        self._read = ReadPlacement(policy, peer_key(config.host_ip, config.handshake_port)) \
            if adaptive and not write else None
        self._turns = PromptTurns() if adaptive and write and config.placement.serve_decode else None
        self._accepted: dict[str, Any] = {}  # legs prefilled here, until their prompt is computed
        self._accepted_transfers: dict[str, str] = {}  # WRITE: request id -> transfer id of each accepted leg
        self._whole: dict[str, Any] = {}  # requests served whole here (not legs), until their prompt is computed
        self._waiting: dict[str, Any] = {}  # WRITE: legs waiting for D's word
        self.own_stream_count = 0  # the streams of requests it serves whole in its last step

    @property
    def publishes_load(self) -> bool:
        return self._gate is not None or self._read is not None

    def start_step(self, scheduled: dict[str, int], new: set[str]) -> None:
        """A step starts: count the requests it gives a generated token that P decodes itself. A
        one-token step is not always one: a leg D prefills itself runs here as the one-token prompt
        it was cut to (scheduled for the first time, like any new request), and a prompt's last
        chunk may be one token."""
        uncomputed_prompt_tokens(self._accepted)
        uncomputed_prompt_tokens(self._whole)
        prompts = self._accepted.keys() | self._whole.keys()
        self.own_stream_count = sum(1 for rid, n in scheduled.items()
                                    if n == 1 and rid not in new and rid not in prompts)

    def prompts_at_a_time(self) -> int:
        return self._turns.in_progress() if self._turns is not None else 1

    def end_pass(self) -> None:
        if self._read is not None:
            self._read.end_pass()

    def on_news(self, news: WorkerNews) -> None:
        if self._gate is not None:
            self._gate.on_decisions(self._shrink_dropped(news.decided))
        if news.statuses and self._read is not None:
            self._read.on_statuses(news.statuses)

    # ---- vLLM's hooks ----------------------------------------------------------------------

    def on_new_request(self, request) -> None:
        """READ: decide where this leg's prompt is prefilled. One left to D is cut to its first
        token now, while nothing of it is computed or allocated."""
        if self._read is None:
            return
        rid = request.request_id
        try:
            params = parse_transfer_params(request.kv_transfer_params, rid, Role.PRODUCER)
            peer = params.require_peer() if params is not None else None
        except ProtocolError:
            return  # legs/prefill_hold.py names the problem
        if params is None or addressed_to_self(params, self._config):
            self._whole[rid] = request  # served whole here: its prompt is in P's queue
            return
        # P's prefix-cache hits are looked up only when vLLM schedules the leg: the whole prompt counts
        tokens = request.num_prompt_tokens
        load = self.load()
        started = sum(r.num_prompt_tokens - r.num_computed_tokens
                      for r in (*self._accepted.values(), *self._whole.values()) if r.num_computed_tokens > 0)
        decision = self._read.decide(tokens, peer, load, next_step_seconds(load, started))
        if decision.placement is Placement.LOCAL and not truncate_to_one_token(request):
            decision = Decision(Placement.REMOTE, decision.reason)
        self._read.placed(rid, peer, decision, tokens)
        if decision.placement is Placement.REMOTE:
            self._accepted[rid] = request

    def matched_tokens(self, request) -> tuple[int | None, bool]:
        if self._read is not None:
            return NOW if self._read.admit(request.request_id) else NOT_YET
        return self._pass_gate(request)

    def allocated(self, request) -> bool:
        """Blocks were allocated; whether the leg has KV to send (one D prefills itself has none)."""
        if self._read is not None:
            self._read.admitted(request.request_id)
        return self._gate is None or not self._gate.dropped(request.request_id)

    def finished(self, request_id: str) -> Decision | None:
        """The request ended; READ: the decision P took for it."""
        self._accepted.pop(request_id, None)
        self._accepted_transfers.pop(request_id, None)
        self._whole.pop(request_id, None)
        self._waiting.pop(request_id, None)
        if self._turns is not None:
            self._turns.forget(request_id)
        if self._gate is not None:
            self._gate.forget(request_id)
        return self._read.finished(request_id) if self._read is not None else None

    def load(self) -> PrefillLoad | None:
        """P's queue and step costs as D's placement reads them (None until P measured its steps)."""
        costs = self._pacer.costs.coefficients()
        if costs is None:
            return None
        queued = uncomputed_prompt_tokens(self._accepted) + uncomputed_prompt_tokens(self._whole)
        for rid in self._accepted_transfers.keys() - self._accepted.keys():
            del self._accepted_transfers[rid]  # computed: no longer in the queue
        counted = list(self._accepted_transfers.values())[:MAX_COUNTED_TRANSFERS]
        share = self._pacer.prefill_share
        return PrefillLoad(self._config.host_ip, self._config.handshake_port, queued, costs.per_prefill_token_s,
                           costs.overhead_s, self._pacer.step_prefill, time.time(), share.share(), share.streams(),
                           counted)

    # ---- WRITE: the gate -------------------------------------------------------------------

    def _pass_gate(self, request) -> tuple[int | None, bool]:
        """Hold a prefill leg until D decided; one D prefills itself has been cut to a one-token
        prompt (leg_truncation.py) and runs as that."""
        if self._gate is None:
            return NOW
        rid = request.request_id
        try:
            params = parse_transfer_params(request.kv_transfer_params, rid, Role.PRODUCER)
            if params is not None:
                params.require_peer()
        except ProtocolError:
            return NOW  # legs/prefill_send.py names the problem
        if params is None:  # not a prefill leg: a request served whole here (serve_decode, or sent to P
            self._whole[rid] = request  # directly); its prompt is in P's queue like an accepted leg's
            return self._take_prompt_turn(request)
        timed_out = self._gate.num_timed_out
        verdict = self._gate.verdict(rid)
        if verdict is Verdict.ASK and addressed_to_self(params, self._config):
            # its decode leg was sent here too (serve_decode) and is served whole: drop this one. vLLM
            # looked up the full prompt's prefix-cache hits for this pass already, so the cut leg
            # waits one step and is looked up again as the one-token prompt it now is
            dropped = truncate_to_one_token(request)
            self._gate.on_decisions({rid: not dropped})
            if dropped:
                self._plan().served_whole += 1
                return NOT_YET
            verdict = self._gate.verdict(rid)
        if verdict is Verdict.ASK:
            self._plan().awaits.append(AwaitSpec(rid, params.transfer_id, params.peer))
            self._waiting[rid] = request
        elif self._gate.num_timed_out > timed_out:  # heard nothing from D in wait_s (on P's /metrics)
            self._plan().placements.append(Decision(Placement.REMOTE, Reason.NO_WORD))
        if verdict in (Verdict.ASK, Verdict.WAIT):
            return NOT_YET
        self._waiting.pop(rid, None)
        if verdict is Verdict.PREFILL:
            self._accepted[rid] = request
            self._accepted_transfers[rid] = params.transfer_id
            return self._take_prompt_turn(request)
        return NOW

    def _take_prompt_turn(self, request) -> tuple[int | None, bool]:
        """With serve_decode: a prompt waits while another is computed beside P's own streams
        (whole_requests.py's PromptTurns); it stays in P's queue meanwhile."""
        if self._turns is None or self._turns.may_start(request, self.own_stream_count):
            return NOW
        return NOT_YET

    def _shrink_dropped(self, decided: dict[str, bool]) -> dict[str, bool]:
        """D's decisions for waiting legs; a leg D prefills itself is cut to one token now, between
        steps, or, if that cannot be done, prefilled after all."""
        out = {}
        for rid, prefill_here in decided.items():
            request = self._waiting.get(rid)
            if request is None:
                continue
            out[rid] = prefill_here or not truncate_to_one_token(request)
        return out
