"""Loads, views and statuses the placement tests decide with."""

from __future__ import annotations

import time

from pdserve.control.address import PeerAddress
from pdserve.placement.config import PlacementConfig
from pdserve.placement.messages import DecodeStatus, PrefillLoad
from pdserve.placement.policy import AdaptivePolicy, DecodeView
from pdserve.placement.read_mode import peer_key
from pdserve.placement.status_view import status_of
from pdserve.placement.step_costs import Coefficients

NOW = 1000.0
COSTS = Coefficients(overhead_s=0.010, per_prefill_token_s=0.001, per_decode_s=0.001)  # 1 ms a prompt token
P_ADDRESS = PeerAddress("127.0.0.1", 6301, 6401)
D_ADDRESS = PeerAddress("127.0.0.1", 6302, 6402)
D_KEY = (D_ADDRESS.host, D_ADDRESS.handshake_port)
P_KEY = peer_key(P_ADDRESS.host, P_ADDRESS.handshake_port)


def load(queued: int, at: float = NOW, per_token_s: float = 0.001) -> PrefillLoad:
    return PrefillLoad("127.0.0.1", 6301, queued, per_token_s, 0.005, 512, at)


def view(running: int = 0, backlog: int = 0, outstanding: int = 0, budget: int = 64, costs=COSTS,
         knows_prefill: bool = True, itl_ms: float | None = None, stream_tokens: float = 64) -> DecodeView:
    return DecodeView(running, backlog, outstanding, budget, costs, knows_prefill,
                      None if itl_ms is None else itl_ms / 1000, stream_tokens)


def policy(itl_target_ms: float = 1000.0, max_step_ms: float = 1000.0) -> AdaptivePolicy:
    return AdaptivePolicy(PlacementConfig("adaptive", itl_target_ms=itl_target_ms, max_step_ms=max_step_ms),
                          clock=lambda: NOW)


def d_status(at: float | None = None, **changes) -> DecodeStatus:
    """An idle D that knows its costs: 5 ms a step, 1 ms a prompt token; its streams ran 64 tokens."""
    idle = DecodeView(0, 0, 0, 576, Coefficients(0.005, 0.001, 0.0005), True, None, 64.0, 512, None)
    status = status_of(idle, D_ADDRESS.host, D_ADDRESS.handshake_port, time.time() if at is None else at, {})
    return DecodeStatus(**{**status.__dict__, **changes})


def busy_p(queued: int = 100_000) -> PrefillLoad:
    return PrefillLoad(P_ADDRESS.host, P_ADDRESS.handshake_port, queued, 0.001, 0.005, 512, time.time())
