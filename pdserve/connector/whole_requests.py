"""Whole requests on P: under adaptive placement with `serve_decode`, P serves some requests itself.

Where decode is the bottleneck (decode-heavy traffic), P's spare capacity is wasted as long as it
only prefills. With `serve_decode`, while D's streams are loaded (serve_gate.py), P registers
with vllm-router as a decode instance too (one process may register as both, registration.py),
so the router sends it a share of the decode legs. Such a request's two legs both land on P, and
each names P as the other's instance:

* its decode leg (`do_remote_prefill`) is, for a producer, a plain request: P prefills it locally
  and decodes it, as plain serving does (nothing to do here);
* its prefill leg names P as its decode instance: pushing KV to itself is never right, so P drops
  the leg at once, cut to one token as a leg D prefills itself (leg_truncation.py).

Which leg arrives first does not matter: each is handled on its own. While requests served whole
decode on P, P limits each step's prompt tokens (its own and D's legs) with the chunk D uses for its
local prompts (local_chunk.py, applied by PDScheduler), so its own streams see no gap longer than
max_step_ms. Free of vLLM.
"""

from __future__ import annotations

from pdserve.config import ConnectorConfig
from pdserve.params import TransferParams

SERVED_WHOLE = "whole:serve_decode"  # placement label of a request P served whole


def addressed_to_self(params: TransferParams, config: ConnectorConfig) -> bool:
    """Whether a prefill leg names this very instance as its decode instance."""
    peer = params.peer
    return peer is not None and (peer.host, peer.handshake_port) == (config.host_ip, config.handshake_port)
