"""The scheduler half of PDConnector: decides, per request, what the worker half must move.

It runs in vLLM's EngineCore process, sees `Request` objects and block ids, and tells the
worker half what to do through a `StepPlan` once per step. It opens no data-plane
socket; the only network it touches is the router registration heartbeat.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any, Callable

from pdserve.config import ConnectorConfig, Role, TransferMode
from pdserve.connector.guard import guarded
from pdserve.connector.leg_truncation import truncate_to_one_token
from pdserve.connector.legs.decode_receive import DecodeReceive
from pdserve.connector.legs.prefill_hold import PrefillHold
from pdserve.connector.legs.prefill_send import PrefillSend
from pdserve.connector.metadata import AwaitSpec, StepPlan
from pdserve.connector.siblings import Family, Siblings
from pdserve.connector.step_pacing import StepPacer
from pdserve.connector.whole_requests import SERVED_WHOLE, PromptTurns, addressed_to_self
from pdserve.errors import ProtocolError
from pdserve.params import parse_transfer_params
from pdserve.placement.decision import Decision, Placement, Reason
from pdserve.placement.decode_load import DecodeLoad, uncomputed_prompt_tokens
from pdserve.placement.inbox import PUBLISH_EVERY_S
from pdserve.placement.messages import MAX_COUNTED_TRANSFERS, DecodeStatus, PrefillLoad
from pdserve.placement.policy import make_policy
from pdserve.placement.prefill_gate import PrefillGate, Verdict
from pdserve.placement.read_mode import ReadPlacement, next_step_seconds, peer_key
from pdserve.placement.serve_gate import STATUS_EVERY_S

logger = logging.getLogger("pdserve.connector")
PLACEMENT_LOG_EVERY_S = 5.0


class PDScheduler:
    """Called by vLLM's scheduler; see vLLM's KVConnectorBase_V1 for when each hook runs."""

    def __init__(self, config: ConnectorConfig, block_size: int, budget: int = 2048, chunk: int | None = None,
                 set_chunk: Callable[[int], None] | None = None):
        self._config = config
        # P, adaptive placement: WRITE, D decides and P's legs wait for its word; READ, P decides
        adaptive = config.placement.adaptive
        producer = adaptive and config.role is Role.PRODUCER
        write = config.mode is TransferMode.WRITE
        self._policy = make_policy(config.placement)
        self._gate = PrefillGate(config.placement.wait_s) if producer and write else None
        self._read = (ReadPlacement(self._policy, peer_key(config.host_ip, config.handshake_port))
                      if producer and not write else None)
        self._accepted: dict[str, Any] = {}  # legs D wants prefilled here, until their prompt is computed
        self._accepted_transfers: dict[str, str] = {}  # WRITE: request id -> transfer id of each accepted leg
        self._whole: dict[str, Any] = {}  # requests served whole here (not legs), until their prompt is computed
        self._legs: dict[str, Any] = {}  # legs waiting for D's word
        # P with serve_decode: its prompts take turns while it decodes streams (whole_requests.py)
        self._turns = PromptTurns() if producer and write and config.placement.serve_decode else None
        self._own_stream_count = 0  # P: the streams of requests it serves whole in its last step
        # D, placement
        self._publishes_status = adaptive and config.role is Role.CONSUMER
        self._status_every_s = STATUS_EVERY_S if write else PUBLISH_EVERY_S
        self._next_status = 0.0
        self._decode_load = DecodeLoad(budget, config.placement.stream_itl_s, chunk=chunk)
        self._pacer = StepPacer(config, budget, self._policy, self._decode_load, set_chunk, lambda: self._meta)
        self._decode = (DecodeReceive(config, block_size, self._policy, self._decode_load, lambda: self._meta,
                                      lambda: self._pacer.chunk_limit) if config.role is Role.CONSUMER else None)
        # P
        self._send = (PrefillSend(config, block_size, lambda: self._meta)
                      if config.role is Role.PRODUCER and write else None)
        self._hold = (PrefillHold(config, block_size, lambda: self._meta)
                      if config.role is Role.PRODUCER and not write else None)
        self._siblings = Siblings()  # the legs of requests with n > 1, which share a transfer (siblings.py)
        self._meta = StepPlan()

    # ---- shared ----------------------------------------------------------------------------

    def bind_kv_cache_manager(self, kv_cache_manager) -> None:
        if self._send is not None:
            self._send.bind_kv_cache_manager(kv_cache_manager)

    def _num_prompt_blocks(self, request) -> int:
        return math.ceil(request.num_prompt_tokens / self._block_size)

    def build_connector_meta(self, scheduler_output) -> StepPlan:
        """The step's plan; what the hooks planned goes out even if planning the rest failed."""
        try:
            self._plan_step(scheduler_output)
        except Exception:  # noqa: BLE001 - the process boundary with vLLM
            logger.exception("pdserve: internal error in build_connector_meta (sending the plan as far as it got)")
        meta, self._meta = self._meta, StepPlan()
        meta.idle = scheduler_output.total_num_scheduled_tokens == 0
        return meta

    def _plan_step(self, scheduler_output) -> None:
        if self._config.role is Role.PRODUCER:
            if self._send is not None:
                self._send.preempted(getattr(scheduler_output, "preempted_req_ids", None) or ())
                self._send.plan_sends(scheduler_output.num_scheduled_tokens)
        new = {r.req_id for r in getattr(scheduler_output, "scheduled_new_reqs", None) or ()}
        scheduled = scheduler_output.num_scheduled_tokens
        self._own_stream_count = self._own_streams(scheduled, new) if self._config.role is Role.PRODUCER else 0
        self._pacer.start(scheduled, self._own_stream_count if self._config.role is Role.PRODUCER else None,
                          self._turns.in_progress() if self._turns is not None else 1)
        if self._gate is not None or self._read is not None:
            self._meta.load = self._prefill_load()
        if self._read is not None:
            self._read.end_pass()
        if self._publishes_status:
            self._meta.status = self._decode_status()

    @guarded()
    def update_connector_output(self, connector_output, news=None) -> None:
        self._pacer.end()
        for request_id in connector_output.finished_sending or ():
            if self._send is not None:
                self._send.sent(request_id)
            if self._hold is not None:
                self._hold.released(request_id)
        landed = 0
        for request_id in connector_output.finished_recving or ():
            if self._decode is not None and self._decode.landed(request_id):
                landed += 1
            self._decode_load.landed(request_id)
        if news is not None:
            if self._gate is not None:
                self._gate.on_decisions(self._shrink_dropped(news.decided))
            self._decode_load.on_loads(news.loads)
            if news.statuses and self._read is not None:
                self._read.on_statuses(news.statuses)
        if landed:
            self._pacer.shorten_for_first_tokens(landed)

    def _own_streams(self, scheduled: dict[str, int], new: set[str]) -> int:
        """P: the requests this step gives a generated token, the streams of those P serves whole.
        A one-token step is not always one: a leg D prefills itself runs here as the one-token prompt it
        was cut to (scheduled for the first time, like any new request), and a prompt's last chunk
        may be one token."""
        uncomputed_prompt_tokens(self._accepted)
        uncomputed_prompt_tokens(self._whole)
        prompts = self._accepted.keys() | self._whole.keys()
        return sum(1 for rid, n in scheduled.items() if n == 1 and rid not in new and rid not in prompts)

    @guarded()
    def on_new_request(self, request) -> None:
        """vLLM added a request to its waiting queue. P, READ, adaptive: place its prompt now."""
        if self._follows(request) is not None:
            return
        if self._read is not None:
            self._place_read_leg(request)

    def _follows(self, request) -> Family | None:
        """The family whose leader `request` follows (siblings.py), joining it on first sight; a
        follower on P is cut to one token then (it moves nothing)."""
        rid = request.request_id
        if rid in self._siblings:
            return self._siblings.follower(rid)
        try:
            params = parse_transfer_params(request.kv_transfer_params, rid, self._config.role)
        except ProtocolError:
            return None  # the hooks name the problem
        if params is None or (self._config.role is Role.PRODUCER and addressed_to_self(params, self._config)):
            return None
        family = self._siblings.join(request, params.transfer_id)
        if family is not None and self._config.role is Role.PRODUCER:
            truncate_to_one_token(request)
        return family

    def _follower_turn(self, family: Family, request) -> tuple[int | None, bool]:
        """Whether a follower may run now. P, READ: after its leader ended, whose kv_transfer_params
        it answers with. D: once its leader's prompt is in D's cache, from which it takes it."""
        if self._config.role is Role.PRODUCER:
            ready = family.leader_done or self._config.mode is TransferMode.WRITE
        else:
            leader = family.leader
            rid = leader.request_id
            computed = not self._decode.receiving(rid) and leader.num_computed_tokens >= leader.num_prompt_tokens
            ready = family.leader_done or self._decode.received(rid) or computed
        return (0, False) if ready else (None, False)

    def has_pending_push_work(self) -> bool:
        legs = self._send if self._send is not None else self._hold
        return bool((legs is not None and legs.holding) or self._meta.cancels or self._meta.holds)

    @guarded(lambda: (0, False))
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        rid = request.request_id
        joined = rid in self._siblings
        family = self._follows(request)
        if family is not None:
            # P: a follower cut just now was looked up in vLLM's prefix cache as the whole prompt
            return (None, False) if not joined and self._config.role is Role.PRODUCER else \
                self._follower_turn(family, request)
        if self._config.role is Role.PRODUCER:
            if self._read is not None:
                return (0, False) if self._read.admit(rid) else (None, False)
            return self._gate_prefill(request, num_computed_tokens)
        return self._decode.matched_tokens(request, num_computed_tokens)

    @guarded()
    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        if self._follows(request) is not None:
            return  # moves nothing
        if self._config.role is Role.PRODUCER:
            if self._read is not None:
                self._read.admitted(request.request_id)
            if self._gate is not None and self._gate.dropped(request.request_id):
                return  # a one-token leg: nothing to send
            if self._send is not None:
                self._send.track(request)
        else:
            self._decode.allocated(request, blocks, num_external_tokens)

    @guarded(lambda: (False, None))
    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        family = self._siblings.follower(rid)
        if family is not None:
            self._siblings.leave(rid)
            answer = family.answer if self._config.role is Role.PRODUCER else None
            return False, dict(answer) if answer is not None else None
        held, answer = False, None
        try:
            if self._config.role is Role.CONSUMER:
                self._decode.finished(request)
            elif self._config.mode is TransferMode.WRITE:
                held, answer = self._finish_write_send(request)
            else:
                held, answer = self._finish_read_send(request, block_ids)
        finally:  # its followers must not wait for a leader that failed
            self._siblings.leader_finished(rid, answer)
            self._siblings.leave(rid)
        return held, answer

    # ---- P ---------------------------------------------------------------------------------

    def _gate_prefill(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Adaptive placement: hold a prefill leg until D decided; one D prefills itself has been
        cut to a one-token prompt (leg_truncation.py) and runs as that."""
        if self._gate is None:
            return 0, False
        rid = request.request_id
        try:
            params = parse_transfer_params(request.kv_transfer_params, rid, Role.PRODUCER)
            if params is not None:
                params.require_peer()
        except ProtocolError:
            return 0, False  # _track_send names the problem
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
                self._meta.placements.append(SERVED_WHOLE)
                return None, False
            verdict = self._gate.verdict(rid)
        if verdict is Verdict.ASK:
            self._meta.awaits.append(AwaitSpec(rid, params.transfer_id, params.peer))
            self._legs[rid] = request
        elif self._gate.num_timed_out > timed_out:  # heard nothing from D in wait_s (on P's /metrics)
            self._meta.placements.append(Decision(Placement.REMOTE, Reason.NO_WORD).label)
        if verdict in (Verdict.ASK, Verdict.WAIT):
            return None, False
        self._legs.pop(rid, None)
        if verdict is Verdict.PREFILL:
            self._accepted[rid] = request
            self._accepted_transfers[rid] = params.transfer_id
            return self._take_prompt_turn(request)
        return 0, False

    def _take_prompt_turn(self, request) -> tuple[int | None, bool]:
        """P with serve_decode: a prompt waits while another is computed beside P's own streams
        (whole_requests.py's PromptTurns); it stays in P's queue meanwhile."""
        if self._turns is None or self._turns.may_start(request, self._own_stream_count):
            return 0, False
        return None, False  # vLLM asks again next step

    def _place_read_leg(self, request) -> None:
        """READ: decide where this leg's prompt is prefilled (placement/read_mode.py). One left to D is cut
        to its first token now, while nothing of it is computed or allocated."""
        rid = request.request_id
        try:
            params = parse_transfer_params(request.kv_transfer_params, rid, Role.PRODUCER)
            peer = params.require_peer() if params is not None else None
        except ProtocolError:
            return  # _finish_read_send names the problem
        if params is None or addressed_to_self(params, self._config):
            self._whole[rid] = request  # served whole here: its prompt is in P's queue
            return
        # P's prefix-cache hits are looked up only when vLLM schedules the leg: the whole prompt counts
        tokens = request.num_prompt_tokens
        load = self._prefill_load()
        started = sum(r.num_prompt_tokens - r.num_computed_tokens
                      for r in (*self._accepted.values(), *self._whole.values()) if r.num_computed_tokens > 0)
        decision = self._read.decide(tokens, peer, load, next_step_seconds(load, started))
        if decision.placement is Placement.LOCAL and not truncate_to_one_token(request):
            decision = Decision(Placement.REMOTE, decision.reason)
        self._read.placed(rid, peer, decision, tokens)
        if decision.placement is Placement.REMOTE:
            self._accepted[rid] = request

    def _shrink_dropped(self, decided: dict[str, bool]) -> dict[str, bool]:
        """D's decisions for waiting legs; a leg D prefills itself is cut to one token now, between
        steps, or, if that cannot be done, prefilled after all."""
        out = {}
        for rid, prefill_here in decided.items():
            request = self._legs.get(rid)
            if request is None:
                continue
            out[rid] = prefill_here or not truncate_to_one_token(request)
        return out

    def _prefill_load(self) -> PrefillLoad | None:
        costs = self._pacer.costs.coefficients()
        if costs is None:
            return None
        queued = uncomputed_prompt_tokens(self._accepted) + uncomputed_prompt_tokens(self._whole)
        for rid in self._accepted_transfers.keys() - self._accepted.keys():
            del self._accepted_transfers[rid]  # computed: no longer in the queue
        counted = list(self._accepted_transfers.values())[:MAX_COUNTED_TRANSFERS]
        return PrefillLoad(self._config.host_ip, self._config.handshake_port, queued, costs.per_prefill_token_s,
                           costs.overhead_s, self._pacer.step_prefill, time.time(), self._pacer.prefill_share.share(),
                           self._pacer.prefill_share.streams(), counted)

    def _finish_write_send(self, request) -> tuple[bool, None]:
        rid = request.request_id
        self._accepted.pop(rid, None)
        self._accepted_transfers.pop(rid, None)
        self._whole.pop(rid, None)
        self._legs.pop(rid, None)
        if self._turns is not None:
            self._turns.forget(rid)
        if self._gate is not None:
            self._gate.forget(rid)
        return self._send.finished(request), None

    def _finish_read_send(self, request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        self._accepted.pop(rid, None)
        self._whole.pop(rid, None)
        decision = self._read.finished(rid) if self._read is not None else None
        return self._hold.finished(request, block_ids, decision)

    def _decode_status(self) -> DecodeStatus | None:
        """READ: our side of P's placement decisions, every PUBLISH_EVERY_S (placement/status_view.py).
        WRITE: how loaded our streams are, for a P that serves whole requests while they are
        (serve_gate.py), every STATUS_EVERY_S."""
        now = time.monotonic()
        if now < self._next_status:
            return None
        self._next_status = now + self._status_every_s
        return self._decode.status()
