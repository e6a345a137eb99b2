"""DecodeScheduler: the scheduler side of a decode instance (D).

Each hook goes to legs/decode_receive.py, which receives a leg's KV or has D compute the prompt
itself (placement decides). A follower of an n > 1 request runs once its leader's prompt is in
D's cache (siblings.py).
"""

from __future__ import annotations

from typing import Any, Callable

from pdserve.config import ConnectorConfig
from pdserve.connector.kv_groups import ONE_GROUP, KvGroups
from pdserve.connector.scheduler.base import PDScheduler
from pdserve.connector.scheduler.legs.decode_receive import DecodeReceive
from pdserve.connector.scheduler.siblings import Family
from pdserve.connector.scheduler.step_pacing import DecodePacer


class DecodeScheduler(PDScheduler):
    _PACER = DecodePacer

    def __init__(self, config: ConnectorConfig, block_size: int, budget: int = 2048, chunk: int | None = None,
                 set_chunk: Callable[[int], None] | None = None, groups: KvGroups = ONE_GROUP):
        super().__init__(config, block_size, budget, chunk, set_chunk, groups)
        self._decode = DecodeReceive(config, block_size, self._policy, self._decode_load, lambda: self._meta,
                                     lambda: self._pacer.chunk_limit, groups)

    def _plan_step(self, scheduler_output) -> None:
        self._pacer.start(scheduler_output.num_scheduled_tokens, None, 1)
        self._meta.status = self._decode.status()

    def _took_output(self, connector_output, news) -> int:
        return sum(1 for request_id in connector_output.finished_recving or () if self._decode.landed(request_id))

    def _matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._decode.matched_tokens(request, num_computed_tokens)

    def _allocated(self, request, blocks, num_external_tokens: int) -> None:
        self._decode.allocated(request, blocks, num_external_tokens)

    def _finished(self, request, block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        self._decode.finished(request)
        return False, None

    def _follower_turn(self, family: Family, joined: bool) -> tuple[int | None, bool]:
        """A follower runs once its leader's prompt is in D's cache, from which it takes it."""
        leader = family.leader
        rid = leader.request_id
        computed = not self._decode.receiving(rid) and leader.num_computed_tokens >= leader.num_prompt_tokens
        ready = family.leader_done or self._decode.received(rid) or computed
        return (0, False) if ready else (None, False)
