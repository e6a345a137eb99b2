"""P, WRITE: prefill legs that push their prompt's KV to D once it is computed.

PrefillScheduler calls these from vLLM's hooks on a producer in WRITE mode; each moves a `Leg` along
legs/base.py's transitions: PREFILLING once its blocks are allocated, SENDING from the step that computes
its last prompt chunk, HELD from its end until the worker reports the send over.
"""

from __future__ import annotations

import logging
import math
from typing import Any, Callable

from pdserve.config import ConnectorConfig, Role
from pdserve.connector.kv_groups import ONE_GROUP, KvGroups
from pdserve.connector.metadata import StepPlan
from pdserve.connector.scheduler.legs.base import Leg, LegStatus
from pdserve.connector.scheduler.prompt_digest import request_digest
from pdserve.connector.scheduler.whole_requests import addressed_to_self
from pdserve.errors import ProtocolError
from pdserve.params import parse_transfer_params
from pdserve.placement import Decision
from pdserve.transfer.specs import CancelSpec, SendSpec

logger = logging.getLogger("pdserve.connector")


class PrefillSend:
    def __init__(self, config: ConnectorConfig, block_size: int, plan: Callable[[], StepPlan],
                 groups: KvGroups = ONE_GROUP):
        self._config = config
        self._block_size = block_size
        self._groups = groups  # KV cache groups: a block list names each group's blocks (kv_groups.py)
        self._plan = plan  # the StepPlan being built
        self._kv_cache_manager = None
        self._legs: dict[str, Leg] = {}

    def bind_kv_cache_manager(self, kv_cache_manager) -> None:
        self._kv_cache_manager = kv_cache_manager

    @property
    def holding(self) -> bool:
        """Legs ended whose blocks the worker still sends from."""
        return any(leg.status is LegStatus.HELD for leg in self._legs.values())

    def plan_step(self, num_scheduled_tokens: dict[str, int], preempted_ids) -> None:
        """A step starts: stop the sends of preempted legs, then plan the sends it makes due."""
        self._preempted(preempted_ids)
        self._plan_sends(num_scheduled_tokens)

    def allocated(self, request) -> None:
        """Blocks were allocated for `request`: a prefill leg sends its KV once its prompt is computed."""
        rid = request.request_id
        if rid in self._legs:
            return
        try:
            params = parse_transfer_params(request.kv_transfer_params, rid, Role.PRODUCER)
            if params is not None:
                params.require_peer()
        except ProtocolError as exc:
            logger.error("pdserve: request %s: bad kv_transfer_params, prefilling without transfer: %s", rid, exc)
            return
        if params is not None and addressed_to_self(params, self._config):
            logger.warning("pdserve: request %s names this instance as its decode instance: its KV stays here", rid)
            return
        if params is not None:
            self._legs[rid] = Leg(request, params, status=LegStatus.PREFILLING)

    def _plan_sends(self, num_scheduled_tokens: dict[str, int]) -> None:
        """A SendSpec for each leg whose last prompt chunk this step computes; a leg that cannot be
        sent is cancelled alone, the others' sends go on."""
        for rid, leg in self._legs.items():
            request = leg.request
            scheduled = num_scheduled_tokens.get(rid, 0)
            if leg.status is not LegStatus.PREFILLING or not scheduled or \
                    request.num_computed_tokens + scheduled < request.num_prompt_tokens:
                continue
            try:
                block_ids = self._kv_cache_manager.get_blocks(rid).get_block_ids()
                send = SendSpec(rid, leg.params.transfer_id, leg.params.peer,
                                self._groups.prompt_blocks(block_ids, math.ceil(request.num_prompt_tokens / self._block_size)),
                                request_digest(request))
            except Exception as exc:  # noqa: BLE001 - this request's fault or not, the others' sends go on
                (logger.error if isinstance(exc, ProtocolError) else logger.exception)(
                    "pdserve: request %s: cannot send its KV, decode recomputes it: %s", rid, exc)
                self._cancel(leg, f"prefill cannot send this request's KV: {exc}")
                continue
            leg.to(LegStatus.SENDING)
            self._plan().sends.append(send)

    def _preempted(self, request_ids) -> None:
        """vLLM frees a preempted request's blocks at once: a send planned from them must stop
        before its copies read reused blocks; D is told, and recomputes (or fails) the request.
        The request stays held at its end so the worker's report of the cancelled send matches."""
        for rid in request_ids:
            leg = self._legs.get(rid)
            if leg is not None and leg.status is LegStatus.SENDING:
                leg.to(LegStatus.PREEMPTED)
                self._plan().cancels.append(CancelSpec(leg.params.transfer_id, leg.params.peer,
                                                       "the prefill request was preempted before its KV was sent"))

    def finished(self, request, block_ids: tuple[list[int], ...], decision: Decision | None
                 ) -> tuple[bool, dict[str, Any] | None]:
        """The request ended; whether its blocks stay until the worker reports its send over (it
        answers with no kv_transfer_params: D has them from the router)."""
        leg = self._legs.get(request.request_id)
        if leg is None:
            return False, None
        if leg.status in (LegStatus.SENDING, LegStatus.PREEMPTED):
            leg.to(LegStatus.HELD)
            return True, None
        if leg.status is LegStatus.PREFILLING:
            self._cancel(leg, "prefill ended before its KV was complete")
        del self._legs[request.request_id]
        return False, None

    def over(self, request_id: str) -> None:
        """The worker reported the send over: vLLM frees the blocks."""
        leg = self._legs.get(request_id)
        if leg is not None and leg.status is LegStatus.HELD:
            del self._legs[request_id]

    def _cancel(self, leg: Leg, reason: str) -> None:
        leg.to(LegStatus.CANCELLED)
        self._plan().cancels.append(CancelSpec(leg.params.transfer_id, leg.params.peer, reason))
