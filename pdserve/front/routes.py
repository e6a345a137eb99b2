"""Which upstream answers a request.

Every request goes to the front's upstream, except those whose answer a PD router builds wrong:
a completion with `echo` and `logprobs` through vllm-router 0.1.17's merge of the prefill and the
decode answers lists the prompt's tokens, logprobs and offsets twice. Those go whole to one decode
instance as a plain request (no kv_transfer_params: it computes the prompt itself), in turn, so the
answer is the one collocated serving gives, streamed or not.

While one of a PD deployment's instances is down (instances.py), every request goes whole to a
live instance instead, as a plain request: the router would send some of them to the dead one.
"""

from __future__ import annotations

import itertools

from pdserve.front.body import RequestBody
from pdserve.front.config import Upstream
from pdserve.front.instances import InstancePool
from pdserve.front.metrics import ROUTED_AROUND, FrontMetrics

COMPLETIONS_PATH = "/v1/completions"


def merge_unsafe(method: str, path: str, body: RequestBody) -> bool:
    """Whether a PD router's merge would answer this request wrong (a completion with echo and logprobs)."""
    if method != "POST" or path != COMPLETIONS_PATH or not body.is_object:
        return False
    return body.field("echo") not in (None, False) and body.field("logprobs") is not None


class Routes:
    """`upstream` for every request; `direct` (in turn) for those merge_unsafe names, where there are
    any; a live one of `instances` for every request while one of them is down (counted)."""

    def __init__(self, upstream: Upstream, direct: tuple[Upstream, ...], instances: InstancePool,
                 metrics: FrontMetrics) -> None:
        self.upstream = upstream
        self._direct = itertools.cycle(direct) if direct else None
        self._instances = instances
        self._metrics = metrics

    def pick(self, method: str, path: str, body: RequestBody) -> Upstream | None:
        """Where the request goes; None when an instance is down and none is live."""
        if not self._instances.all_up:
            instance = self._instances.pick()
            if instance is not None:
                self._metrics.count(ROUTED_AROUND)
            return instance
        if self._direct is not None and merge_unsafe(method, path, body):
            return next(self._direct)
        return self.upstream
