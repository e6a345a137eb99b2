"""D's side of a placement decision, on the wire: a `DecodeView` as a `DecodeStatus` and back.

In READ mode vllm-router sends a request's decode leg only after its prefill leg returned, so P
decides placement (read_mode.py) and D publishes its view to P, as P publishes its queue to
D in WRITE mode. In WRITE mode D publishes it too, less often: a P with serve_decode judges its
streams' load from it (mean ITL over the last seconds, running streams, step costs: serve_gate.py).
Free of vLLM.
"""

from __future__ import annotations

from pdserve.placement.chunk_size import STEP_HEADROOM
from pdserve.placement.messages import DecodeStatus
from pdserve.placement.policy import DecodeView
from pdserve.placement.step_costs import Coefficients


def status_of(view: DecodeView, host: str, handshake_port: int, at: float,
              placed_local: dict[str, int]) -> DecodeStatus:
    """`placed_local`: per prefill instance ("host:port"), how many prompts it left to D that D
    has taken in (read_mode.py counts the rest as on their way)."""
    costs = view.costs
    return DecodeStatus(
        host, handshake_port, view.running_decodes, view.local_backlog_tokens, view.budget, view.chunk,
        view.knows_prefill, view.stream_tokens, at, dict(placed_local),
        overhead_s=costs.overhead_s if costs else None,
        per_token_s=costs.per_prefill_token_s if costs else None,
        per_decode_s=costs.per_decode_s if costs else None,
        recent_itl_s=view.recent_itl_s, prefill_token_s=view.prefill_token_s, now_itl_s=view.now_itl_s,
        chunk_headroom=view.chunk_headroom)


def view_of(status: DecodeStatus, sent_local_tokens: int = 0) -> DecodeView:
    """The view P decides with: D's, plus `sent_local_tokens` P told D to prefill itself after D
    measured it. P's own queue is in P's load, so nothing is outstanding on D's side. A status
    without a chunk headroom plans D's chunks at STEP_HEADROOM."""
    return DecodeView(status.running_decodes, status.local_backlog_tokens + sent_local_tokens, 0, status.budget,
                      costs_of(status), status.knows_prefill, status.recent_itl_s, status.stream_tokens, status.chunk,
                      status.prefill_token_s, status.now_itl_s,
                      STEP_HEADROOM if status.chunk_headroom is None else status.chunk_headroom)


def costs_of(status: DecodeStatus) -> Coefficients | None:
    """D's fitted step costs as it published them (None: not measured yet)."""
    if status.overhead_s is None:
        return None
    return Coefficients(status.overhead_s, status.per_token_s, status.per_decode_s)
