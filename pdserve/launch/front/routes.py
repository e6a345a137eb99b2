"""Which upstream answers a request.

Every request goes to the front's upstream, except those whose answer a PD router builds wrong:
a completion with `echo` and `logprobs` through vllm-router 0.1.17's merge of the prefill and the
decode answers lists the prompt's tokens, logprobs and offsets twice. Those go whole to one decode
instance as a plain request (no kv_transfer_params: it computes the prompt itself), in turn, so the
answer is the one collocated serving gives, streamed or not.
"""

from __future__ import annotations

import itertools
import json

from pdserve.launch.front.config import Upstream

COMPLETIONS_PATH = "/v1/completions"


def merge_unsafe(method: str, path: str, body: bytes) -> bool:
    """Whether a PD router's merge would answer this request wrong (a completion with echo and logprobs)."""
    if method != "POST" or path != COMPLETIONS_PATH or b'"echo"' not in body:
        return False
    try:
        request = json.loads(body)
    except ValueError:
        return False  # the upstream names what is wrong with it
    if not isinstance(request, dict):
        return False
    return request.get("echo") not in (None, False) and request.get("logprobs") is not None


class Routes:
    """`upstream` for every request; `direct` (in turn) for those merge_unsafe names, where there are any."""

    def __init__(self, upstream: Upstream, direct: tuple[Upstream, ...]) -> None:
        self.upstream = upstream
        self._direct = itertools.cycle(direct) if direct else None

    def pick(self, method: str, path: str, body: bytes) -> Upstream:
        if self._direct is not None and merge_unsafe(method, path, body):
            return next(self._direct)
        return self.upstream
