"""Whole requests on P: under adaptive placement with `serve_decode`, P serves some requests itself.

Where decode is the bottleneck (decode-heavy traffic), P's spare capacity is wasted as long as it
only prefills. With `serve_decode`, while D's streams are loaded (placement/serve_gate.py), P registers
with vllm-router as a decode instance too (one process may register as both, registration.py),
so the router sends it a share of the decode legs. Such a request's two legs both land on P, and
each names P as the other's instance:

* its decode leg (`do_remote_prefill`) is, for a producer, a plain request: P prefills it locally
  and decodes it, as plain serving does (nothing to do here);
* its prefill leg names P as its decode instance: pushing KV to itself is never right, so P drops
  the leg at once, cut to one token as a leg D prefills itself (leg_truncation.py).

Which leg arrives first does not matter: each is handled on its own. While requests served whole
decode on P, P limits each step's prompt tokens (its own and D's legs) with the chunk D uses for its
local prompts (placement/chunk_size.py, applied by PDScheduler), so its own streams see no gap longer than
max_step_ms. vLLM applies that limit to each prompt of a step, and only a max-num-batched-tokens
budget bounds their sum, so while P decodes streams it computes one prompt at a time (`PromptTurns`),
as D does its local ones: prompts admitted together would run steps far past the bound. Free of vLLM.
"""

from __future__ import annotations

from typing import Any

from pdserve.config import ConnectorConfig
from pdserve.params import TransferParams
from pdserve.placement import uncomputed_prompt_tokens


def addressed_to_self(params: TransferParams, config: ConnectorConfig) -> bool:
    """Whether a prefill leg names this very instance as its decode instance."""
    peer = params.peer
    return peer is not None and (peer.host, peer.handshake_port) == (config.host_ip, config.handshake_port)


class PromptTurns:
    """P with serve_decode: the prompts it computes (D's legs, requests it serves whole) take turns
    while it decodes streams of its own. A prompt may start when P decodes none, or when no other
    prompt it started is left to compute; the others wait (vLLM asks again next step), in the order
    vLLM asks, which is its waiting queue's."""

    def __init__(self) -> None:
        self._started: dict[str, Any] = {}  # request id -> vLLM request, until its prompt is computed

    def may_start(self, request, streams: int) -> bool:
        """Whether `request`'s prompt may be scheduled now, with P decoding `streams` streams of its
        own; if so it counts as started until its prompt is computed or `forget` is called."""
        rid = request.request_id
        self._forget_computed()
        if rid not in self._started and streams > 0 and self._started:
            return False
        self._started[rid] = request
        return True

    def in_progress(self) -> int:
        """Prompts started and not yet computed."""
        self._forget_computed()
        return len(self._started)

    def forget(self, rid: str) -> None:
        self._started.pop(rid, None)

    def _forget_computed(self) -> None:
        uncomputed_prompt_tokens(self._started)  # drops the prompts already computed
