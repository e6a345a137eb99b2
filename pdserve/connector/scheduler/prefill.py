"""PrefillScheduler: the scheduler side of a prefill instance (P).

Each hook goes to prefill_placement.py (where a leg's prompt is computed) and to the legs that
move its KV: legs/prefill_send.py (WRITE) or legs/prefill_hold.py (READ), chosen once by mode. A
follower of an n > 1 request is cut to one token (siblings.py); a leg of a model with mamba or
linear-attention state leaves the prompt's last tokens to D (kv_groups.py).
"""

from __future__ import annotations

from typing import Any, Callable

from pdserve.config import ConnectorConfig, TransferMode
from pdserve.connector.guard import guarded
from pdserve.connector.kv_groups import ONE_GROUP, KvGroups
from pdserve.connector.scheduler.base import PDScheduler
from pdserve.connector.scheduler.leg_truncation import truncate_prompt, truncate_to_one_token
from pdserve.connector.scheduler.legs.prefill_hold import PrefillHold
from pdserve.connector.scheduler.legs.prefill_send import PrefillSend
from pdserve.connector.scheduler.prefill_placement import NOT_YET, NOW, PrefillPlacement
from pdserve.connector.scheduler.siblings import Family
from pdserve.connector.scheduler.step_pacing import PrefillPacer
from pdserve.connector.scheduler.whole_requests import addressed_to_self
from pdserve.errors import ProtocolError
from pdserve.params import TransferParams, parse_transfer_params


class PrefillScheduler(PDScheduler):
    _PACER = PrefillPacer

    def __init__(self, config: ConnectorConfig, block_size: int, budget: int = 2048, chunk: int | None = None,
                 set_chunk: Callable[[int], None] | None = None, groups: KvGroups = ONE_GROUP):
        super().__init__(config, block_size, budget, chunk, set_chunk, groups)
        self._placement = PrefillPlacement(config, self._policy, self._pacer, lambda: self._meta)
        legs = PrefillSend if config.mode is TransferMode.WRITE else PrefillHold
        self._legs: PrefillSend | PrefillHold = legs(config, block_size, lambda: self._meta, groups)

    def bind_kv_cache_manager(self, kv_cache_manager) -> None:
        self._legs.bind_kv_cache_manager(kv_cache_manager)

    @guarded()
    def on_new_request(self, request) -> None:
        """vLLM added a request to its waiting queue. A leg of a model with mamba or linear-attention
        state leaves the prompt's last tokens to D (kv_groups.py); READ, adaptive: place its prompt now."""
        if self._follows(request) is None:
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

    def _plan_step(self, scheduler_output) -> None:
        scheduled = scheduler_output.num_scheduled_tokens
        self._legs.plan_step(scheduled, getattr(scheduler_output, "preempted_req_ids", None) or ())
        placement = self._placement
        placement.start_step(scheduled, {r.req_id for r in getattr(scheduler_output, "scheduled_new_reqs", None) or ()})
        self._pacer.start(scheduled, placement.own_stream_count, placement.prompts_at_a_time())
        if placement.publishes_load:
            self._meta.load = placement.load()
        placement.end_pass()

    def _took_output(self, connector_output, news) -> int:
        for request_id in connector_output.finished_sending or ():
            self._legs.over(request_id)
        if news is not None:
            self._placement.on_news(news)
        return 0

    def _holding(self) -> bool:
        return self._legs.holding

    def _matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._placement.matched_tokens(request)

    def _allocated(self, request, blocks, num_external_tokens: int) -> None:
        if self._placement.allocated(request):
            self._legs.allocated(request)

    def _finished(self, request, block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        decision = self._placement.finished(request.request_id)
        return self._legs.finished(request, block_ids, decision)

    def _served_whole(self, params: TransferParams) -> bool:
        return addressed_to_self(params, self._config)

    def _joined_as_follower(self, request) -> None:
        truncate_to_one_token(request)  # it moves nothing

    def _follower_turn(self, family: Family, joined: bool) -> tuple[int | None, bool]:
        """A follower cut just now was looked up in vLLM's prefix cache as the whole prompt: it waits
        a step. READ: it runs after its leader ended, whose kv_transfer_params it answers with."""
        if not joined:
            return NOT_YET
        return NOW if family.leader_done or self._config.mode is TransferMode.WRITE else NOT_YET
