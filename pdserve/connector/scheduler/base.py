"""PDScheduler: the scheduler side of PDConnector, what both roles share.

It runs in vLLM's EngineCore process, sees `Request` objects and block ids, and tells the worker
side what to do through a `StepPlan` once per step. It opens no data-plane socket; the only
network it touches is the router registration heartbeat.

A side's role is its class, chosen once by `scheduler_for` (scheduler/__init__.py):
prefill.py's `PrefillScheduler` (P) and decode.py's `DecodeScheduler` (D) answer the hooks
this base hands on. What both share lives here: the step plan, the step clock (step_pacing.py,
which times the steps the cost models learn from) and the n children of a request, which share
one transfer (siblings.py).
"""

from __future__ import annotations

import logging
from typing import Any, Callable

from pdserve.config import ConnectorConfig
from pdserve.connector.guard import guarded
from pdserve.connector.kv_groups import ONE_GROUP, KvGroups
from pdserve.connector.metadata import StepPlan
from pdserve.connector.scheduler.siblings import Family, Siblings
from pdserve.connector.scheduler.step_pacing import StepPacer
from pdserve.errors import ProtocolError
from pdserve.params import TransferParams, parse_transfer_params
from pdserve.placement import DecodeLoad, make_policy

logger = logging.getLogger("pdserve.connector")


class PDScheduler:
    """Called by vLLM's scheduler; see vLLM's KVConnectorBase_V1 for when each hook runs.
    Subclasses answer the hooks of one role (the methods below that raise NotImplementedError),
    and name their role's step pacer (step_pacing.py)."""

    _PACER: type[StepPacer]

    def __init__(self, config: ConnectorConfig, block_size: int, budget: int = 2048, chunk: int | None = None,
                 set_chunk: Callable[[int], None] | None = None, groups: KvGroups = ONE_GROUP):
        self._config = config
        self._block_size = block_size
        self._groups = groups
        self._policy = make_policy(config.placement)
        self._decode_load = DecodeLoad(budget, config.placement.stream_itl_s, chunk=chunk)
        self._pacer = self._PACER(config, budget, self._policy, self._decode_load, set_chunk, lambda: self._meta)
        self._siblings = Siblings()  # the legs of requests with n > 1, which share a transfer (siblings.py)
        self._meta = StepPlan()

    # ---- vLLM's hooks ----------------------------------------------------------------------

    def bind_kv_cache_manager(self, kv_cache_manager) -> None:
        pass  # P's legs read block ids from it

    def build_connector_meta(self, scheduler_output) -> StepPlan:
        """The step's plan; what the hooks planned goes out even if planning the rest failed."""
        try:
            self._plan_step(scheduler_output)
        except Exception:  # noqa: BLE001 - the process boundary with vLLM
            logger.exception("pdserve: internal error in build_connector_meta (sending the plan as far as it got)")
        meta, self._meta = self._meta, StepPlan()
        meta.idle = scheduler_output.total_num_scheduled_tokens == 0
        return meta

    @guarded()
    def update_connector_output(self, connector_output, news=None) -> None:
        self._pacer.end()
        landed = self._took_output(connector_output, news)
        for request_id in connector_output.finished_recving or ():
            self._decode_load.landed(request_id)
        if news is not None:
            self._decode_load.on_loads(news.loads)
        if landed:
            self._pacer.shorten_for_first_tokens(landed)

    @guarded()
    def on_new_request(self, request) -> None:
        """vLLM added a request to its waiting queue."""
        self._follows(request)

    def has_pending_push_work(self) -> bool:
        return bool(self._holding() or self._meta.cancels or self._meta.holds)

    @guarded(lambda: (0, False))
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        joined = request.request_id in self._siblings
        family = self._follows(request)
        if family is not None:
            return self._follower_turn(family, joined)
        return self._matched_tokens(request, num_computed_tokens)

    @guarded()
    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        if self._follows(request) is not None:
            return  # moves nothing
        self._allocated(request, blocks, num_external_tokens)

    @guarded(lambda: (False, None))
    def request_finished(self, request, block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        """`block_ids`: the request's blocks, one list per KV cache group (kv_groups.py)."""
        rid = request.request_id
        family = self._siblings.follower(rid)
        if family is not None:
            self._siblings.leave(rid)
            answer = family.answer  # only P, READ answers with its leader's params
            return False, dict(answer) if answer is not None else None
        held, answer = False, None
        try:
            held, answer = self._finished(request, block_ids)
        finally:  # its followers must not wait for a leader that failed
            self._siblings.leader_finished(rid, answer)
            self._siblings.leave(rid)
        return held, answer

    # ---- what each role answers ------------------------------------------------------------

    def _plan_step(self, scheduler_output) -> None:
        """Fill the step's plan from vLLM's scheduler output."""
        raise NotImplementedError

    def _took_output(self, connector_output, news) -> int:
        """The worker's report of the last step (and its news, if any); how many requests whose KV
        D waited for landed."""
        raise NotImplementedError

    def _holding(self) -> bool:
        """Whether blocks of ended requests are held for a transfer still under way."""
        return False

    def _matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        raise NotImplementedError

    def _allocated(self, request, blocks, num_external_tokens: int) -> None:
        raise NotImplementedError

    def _finished(self, request, block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        """A request that leads its family (or has none) ended: whether its blocks stay, and the
        kv_transfer_params it answers with."""
        raise NotImplementedError

    def _served_whole(self, params: TransferParams) -> bool:
        """Whether a request with these params is served whole here (then it has no family)."""
        return False

    def _joined_as_follower(self, request) -> None:
        """`request` just joined a family as a follower."""

    def _follower_turn(self, family: Family, joined: bool) -> tuple[int | None, bool]:
        """Whether a follower may run now (`joined`: it was a member before this hook)."""
        raise NotImplementedError

    # ---- n > 1 (siblings.py) ---------------------------------------------------------------

    def _follows(self, request) -> Family | None:
        """The family whose leader `request` follows, joining it on first sight."""
        rid = request.request_id
        if rid in self._siblings:
            return self._siblings.follower(rid)
        try:
            params = parse_transfer_params(request.kv_transfer_params, rid, self._config.role)
        except ProtocolError:
            return None  # the hooks name the problem
        if params is None or self._served_whole(params):
            return None
        family = self._siblings.join(request, params.transfer_id)
        if family is not None:
            self._joined_as_follower(request)
        return family
