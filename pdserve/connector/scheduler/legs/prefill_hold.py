"""P, READ: prefill legs whose blocks P holds, once the prompt is computed, for D to read.

The leg ends with its prompt computed; P keeps its blocks (HoldSpec) until D released them or the
hold expires, and answers with kv_transfer_params naming them (params.py), which vllm-router hands
to the decode leg. A leg placed on D (placement/read_mode.py) was cut to one token and holds nothing.

With KV on a GPU staged in host memory (config.host_staging) D reads P's host mirror, which the
worker fills only when told: the step that computes a leg's last prompt chunk carries a StageSpec
for its blocks, and the worker stages them before that step ends, so before the answer that
names them leaves P. Without staging nothing is tracked for it.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any, Callable

from pdserve.config import ConnectorConfig, Role
from pdserve.connector.kv_groups import ONE_GROUP, KvGroups
from pdserve.connector.metadata import StageSpec, StepPlan
from pdserve.connector.scheduler.legs.base import Leg, LegStatus
from pdserve.connector.scheduler.prompt_digest import request_digest
from pdserve.control.address import PeerAddress
from pdserve.errors import ProtocolError
from pdserve.params import Held, build_transfer_params, parse_transfer_params
from pdserve.placement import Decision, Placement
from pdserve.transfer.specs import HoldSpec

logger = logging.getLogger("pdserve.connector")


class PrefillHold:
    def __init__(self, config: ConnectorConfig, block_size: int, plan: Callable[[], StepPlan],
                 groups: KvGroups = ONE_GROUP):
        self._config = config
        self._block_size = block_size
        self._groups = groups  # KV cache groups: a block list names each group's blocks (kv_groups.py)
        self._plan = plan  # the StepPlan being built
        self._own = PeerAddress(config.host_ip, config.handshake_port, config.notify_port)
        self._held: dict[str, Leg] = {}  # legs ended whose blocks P holds until the worker reports the hold over
        self._kv_cache_manager = None
        self._staged: dict[str, Any] = {}  # host staging: legs (request id -> request) still prefilling

    @property
    def stages(self) -> bool:
        """Whether the held blocks must be staged in host memory (module docstring)."""
        return self._config.host_staging

    def bind_kv_cache_manager(self, kv_cache_manager) -> None:
        self._kv_cache_manager = kv_cache_manager

    def plan_step(self, num_scheduled_tokens: dict[str, int], preempted_ids) -> None:
        """A step starts: with host staging, plan the stages it makes due (a preempted leg is staged
        again when its last prompt chunk is computed again)."""
        if self.stages:
            self._plan_stages(num_scheduled_tokens)

    def allocated(self, request) -> None:
        """Blocks were allocated for `request`, a leg whose prompt is computed here: tracked for
        host staging."""
        if not self.stages:
            return
        try:
            params = parse_transfer_params(request.kv_transfer_params, request.request_id, Role.PRODUCER)
        except ProtocolError:
            return  # `finished` names the problem
        if params is not None:
            self._staged[request.request_id] = request

    def _plan_stages(self, num_scheduled_tokens: dict[str, int]) -> None:
        """A StageSpec for each tracked leg whose last prompt chunk this step computes (again, after
        a preemption)."""
        for rid, request in self._staged.items():
            scheduled = num_scheduled_tokens.get(rid, 0)
            computed = request.num_computed_tokens
            if not scheduled or computed >= request.num_prompt_tokens or \
                    computed + scheduled < request.num_prompt_tokens:
                continue
            params = parse_transfer_params(request.kv_transfer_params, rid, Role.PRODUCER)
            num_blocks = math.ceil(request.num_prompt_tokens / self._block_size)
            block_ids = self._kv_cache_manager.get_blocks(rid).get_block_ids()
            self._plan().stages.append(StageSpec(rid, params.transfer_id,
                                                 self._groups.prompt_blocks(block_ids, num_blocks)))

    @property
    def holding(self) -> bool:
        return bool(self._held)

    def finished(self, request, block_ids: tuple[list[int], ...], decision: Decision | None
                 ) -> tuple[bool, dict[str, Any] | None]:
        """The request ended (`block_ids`: one list per KV cache group): whether P holds its blocks,
        and the kv_transfer_params it answers with."""
        rid = request.request_id
        self._staged.pop(rid, None)
        try:
            params = parse_transfer_params(request.kv_transfer_params, rid, Role.PRODUCER)
        except ProtocolError as exc:
            logger.error("pdserve: request %s: bad kv_transfer_params, not holding its KV: %s", rid, exc)
            return False, None
        if params is None or not _prefill_complete(request):
            return False, None
        if decision is not None and decision.placement is Placement.LOCAL:  # cut to one token: nothing held
            return False, build_transfer_params(params.transfer_id, self._config.engine_id, self._own, None, decision)
        num_blocks = math.ceil(request.num_prompt_tokens / self._block_size)
        try:
            prompt_blocks = self._groups.prompt_blocks(block_ids, num_blocks)
        except ProtocolError as exc:
            logger.error("pdserve: request %s: not holding its KV: %s", rid, exc)
            return False, None
        held = Held(prompt_blocks, time.time() + self._config.defer_timeout, request_digest(request))
        leg = Leg(request, params)
        leg.to(LegStatus.HELD)
        self._held[rid] = leg
        self._plan().holds.append(HoldSpec(rid, params.transfer_id, held.block_ids, held.expires_at, held.prompt_hash))
        return True, build_transfer_params(params.transfer_id, self._config.engine_id, self._own, held, decision)

    def over(self, request_id: str) -> None:
        """The worker reported the hold over (D read the blocks, released them, or the hold expired)."""
        self._held.pop(request_id, None)


def _prefill_complete(request) -> bool:
    """A prefill leg that computed its whole prompt and ended normally (its max_tokens, or a stop
    or EOS token as its first token) hands over its KV; one aborted or failed does not."""
    finished_normally = getattr(request.status, "name", None) in ("FINISHED_LENGTH_CAPPED", "FINISHED_STOPPED")
    return finished_normally and request.num_computed_tokens >= request.num_prompt_tokens
