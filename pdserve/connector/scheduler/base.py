"""The scheduler half of PDConnector: decides, per request, what the worker half must move.

It runs in vLLM's EngineCore process, sees `Request` objects and block ids, and tells the
worker half what to do through a `StepPlan` once per step. It opens no data-plane
socket; the only network it touches is the router registration heartbeat.

Each hook goes to the classes of the instance's role: on D legs/decode_receive.py; on P
prefill_placement.py (where a leg's prompt is computed) and legs/prefill_send.py (WRITE) or
legs/prefill_hold.py (READ), which move its KV. The n children of a request share one transfer
(siblings.py); step_pacing.py times the steps the cost models learn from.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

from pdserve.config import ConnectorConfig, Role, TransferMode
from pdserve.connector.guard import guarded
from pdserve.connector.kv_groups import ONE_GROUP, KvGroups
from pdserve.connector.metadata import StepPlan
from pdserve.connector.scheduler.leg_truncation import truncate_prompt, truncate_to_one_token
from pdserve.connector.scheduler.legs.decode_receive import DecodeReceive
from pdserve.connector.scheduler.legs.prefill_hold import PrefillHold
from pdserve.connector.scheduler.legs.prefill_send import PrefillSend
from pdserve.connector.scheduler.prefill_placement import PrefillPlacement
from pdserve.connector.scheduler.siblings import Family, Siblings
from pdserve.connector.scheduler.step_pacing import StepPacer
from pdserve.connector.scheduler.whole_requests import addressed_to_self
from pdserve.errors import ProtocolError
from pdserve.params import parse_transfer_params
from pdserve.placement.decode_load import DecodeLoad
from pdserve.placement.policy import make_policy

logger = logging.getLogger("pdserve.connector")


class PDScheduler:
    """Called by vLLM's scheduler; see vLLM's KVConnectorBase_V1 for when each hook runs."""

    def __init__(self, config: ConnectorConfig, block_size: int, budget: int = 2048, chunk: int | None = None,
                 set_chunk: Callable[[int], None] | None = None, groups: KvGroups = ONE_GROUP):
        self._config = config
        self._groups = groups
        policy = make_policy(config.placement)
        self._decode_load = DecodeLoad(budget, config.placement.stream_itl_s, chunk=chunk)
        self._pacer = StepPacer(config, budget, policy, self._decode_load, set_chunk, lambda: self._meta)
        # D
        self._decode = (DecodeReceive(config, block_size, policy, self._decode_load, lambda: self._meta,
                                      lambda: self._pacer.chunk_limit, groups) if config.role is Role.CONSUMER else None)
        # P: where its legs' prompts are prefilled, and the legs that move their KV (WRITE) or hold it (READ)
        producer, write = config.role is Role.PRODUCER, config.mode is TransferMode.WRITE
        self._placement = PrefillPlacement(config, policy, self._pacer, lambda: self._meta) if producer else None
        self._send = PrefillSend(config, block_size, lambda: self._meta, groups) if producer and write else None
        self._hold = PrefillHold(config, block_size, lambda: self._meta, groups) if producer and not write else None
        self._siblings = Siblings()  # the legs of requests with n > 1, which share a transfer (siblings.py)
        self._meta = StepPlan()

    # ---- shared ----------------------------------------------------------------------------

    def bind_kv_cache_manager(self, kv_cache_manager) -> None:
        legs = self._send or self._hold
        if legs is not None:
            legs.bind_kv_cache_manager(kv_cache_manager)

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
        scheduled = scheduler_output.num_scheduled_tokens
        if self._send is not None:
            self._send.preempted(getattr(scheduler_output, "preempted_req_ids", None) or ())
            self._send.plan_sends(scheduled)
        if self._hold is not None and self._hold.stages:
            self._hold.plan_stages(scheduled)
        placement = self._placement
        if placement is None:
            self._pacer.start(scheduled, None, 1)
            self._meta.status = self._decode.status()
            return
        placement.start_step(scheduled, {r.req_id for r in getattr(scheduler_output, "scheduled_new_reqs", None) or ()})
        self._pacer.start(scheduled, placement.own_stream_count, placement.prompts_at_a_time())
        if placement.publishes_load:
            self._meta.load = placement.load()
        placement.end_pass()

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
            if self._placement is not None:
                self._placement.on_news(news)
            self._decode_load.on_loads(news.loads)
        if landed:
            self._pacer.shorten_for_first_tokens(landed)

    @guarded()
    def on_new_request(self, request) -> None:
        """vLLM added a request to its waiting queue. P: a leg of a model with mamba or
        linear-attention state leaves the prompt's last tokens to D (kv_groups.py); READ, adaptive:
        place its prompt now."""
        if self._follows(request) is None and self._placement is not None:
            if self._groups.has_state and self._is_leg(request):
                truncate_prompt(request, self._groups.moved_tokens(request.num_prompt_tokens))
            self._placement.on_new_request(request)

    def _is_leg(self, request) -> bool:
        """A prefill leg, whose KV goes to another instance (not a request served whole here)."""
        try:
            params = parse_transfer_params(request.kv_transfer_params, request.request_id, self._config.role)
        except ProtocolError:
            return False  # the hooks name the problem
        return params is not None and not addressed_to_self(params, self._config)

    def has_pending_push_work(self) -> bool:
        legs = self._send if self._send is not None else self._hold
        return bool((legs is not None and legs.holding) or self._meta.cancels or self._meta.holds)

    @guarded(lambda: (0, False))
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        joined = request.request_id in self._siblings
        family = self._follows(request)
        if family is not None:
            # P: a follower cut just now was looked up in vLLM's prefix cache as the whole prompt
            return (None, False) if not joined and self._placement is not None else \
                self._follower_turn(family)
        if self._placement is not None:
            return self._placement.matched_tokens(request)
        return self._decode.matched_tokens(request, num_computed_tokens)

    @guarded()
    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        if self._follows(request) is not None:
            return  # moves nothing
        if self._placement is None:
            self._decode.allocated(request, blocks, num_external_tokens)
        elif self._placement.allocated(request):
            if self._send is not None:
                self._send.track(request)
            elif self._hold.stages:
                self._hold.track(request)

    @guarded(lambda: (False, None))
    def request_finished(self, request, block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        """`block_ids`: the request's blocks, one list per KV cache group (kv_groups.py)."""
        rid = request.request_id
        family = self._siblings.follower(rid)
        if family is not None:
            self._siblings.leave(rid)
            answer = family.answer if self._placement is not None else None
            return False, dict(answer) if answer is not None else None
        held, answer = False, None
        try:
            if self._placement is None:
                self._decode.finished(request)
            else:
                decision = self._placement.finished(rid)
                if self._send is not None:
                    held = self._send.finished(request)
                else:
                    held, answer = self._hold.finished(request, block_ids, decision)
        finally:  # its followers must not wait for a leader that failed
            self._siblings.leader_finished(rid, answer)
            self._siblings.leave(rid)
        return held, answer

    # ---- n > 1 (siblings.py) ---------------------------------------------------------------

    def _follows(self, request) -> Family | None:
        """The family whose leader `request` follows, joining it on first sight; a follower on P is
        cut to one token then (it moves nothing)."""
        rid = request.request_id
        if rid in self._siblings:
            return self._siblings.follower(rid)
        try:
            params = parse_transfer_params(request.kv_transfer_params, rid, self._config.role)
        except ProtocolError:
            return None  # the hooks name the problem
        if params is None or (self._placement is not None and addressed_to_self(params, self._config)):
            return None
        family = self._siblings.join(request, params.transfer_id)
        if family is not None and self._placement is not None:
            truncate_to_one_token(request)
        return family

    def _follower_turn(self, family: Family) -> tuple[int | None, bool]:
        """Whether a follower may run now. P, READ: after its leader ended, whose kv_transfer_params
        it answers with. D: once its leader's prompt is in D's cache, from which it takes it."""
        if self._placement is not None:
            ready = family.leader_done or self._config.mode is TransferMode.WRITE
        else:
            leader = family.leader
            rid = leader.request_id
            computed = not self._decode.receiving(rid) and leader.num_computed_tokens >= leader.num_prompt_tokens
            ready = family.leader_done or self._decode.received(rid) or computed
        return (0, False) if ready else (None, False)
