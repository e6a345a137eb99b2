"""Balance: where a prompt goes while P decodes streams of its own.

With `serve_decode` (serve_gate.py) P also serves whole requests once D's streams are loaded.
From then on P's time is no longer free: a prompt P prefills for D stalls P's streams just as a
local prefill stalls D's, and a remote prompt still pays what the split costs it in TTFT (P's
step, the KV hop, D's first step). The rules that send a prompt to P because P is idle or meets
the TTFT bound protect D's streams at P's expense, which is right while P has no streams and
wrong once it has: P's streams would advance slower than D's while D keeps its time.

So while P decodes, the prompt goes to the side whose streams advance faster with it counted, as
plain serving on two instances prefills each prompt beside its own streams. A side's streams
advance at its decode step stretched by its prefill work: D's by what its last seconds measured
(or its fitted step for the streams it runs, whichever is slower), P's by D's fitted step for
P's streams over the share of P's time its prefill steps took (the model of serve_gate.py), and
the prompt adds its prefill time spread over a stream's tokens on the side that computes it.
Free of vLLM.
"""

from __future__ import annotations

from pdserve.placement.messages import PrefillLoad
from pdserve.placement.step_costs import Coefficients

# While P decodes too, D prefills about half the prompts itself, so its local steps may run this
# many times the response bound (chunk_size.py): at the plain bound a short prompt would take
# several chunk steps, each paying the step overhead, and lose to the remote path.
RESPONSE_STRETCH = 2.0
MAX_STRETCH = 10.0  # a side that spends nearly all its time prefilling: its streams at most this much slower


def streams_now_itl(now_itl_s: float | None, costs: Coefficients | None, streams: int) -> float | None:
    """How slowly a decode instance's `streams` advance now: the larger of their mean ITL over the
    last few seconds and the decode-only step its fitted `costs` predict for them (it follows
    arrivals before any token shows them); None where neither is known (no stream, or no costs)."""
    known = [now_itl_s] if now_itl_s is not None else []
    if costs is not None and streams:
        known.append(costs.step_seconds(0, streams))
    return max(known, default=None)


def decode_streams_itl(view, costs: Coefficients) -> float:
    """How slowly D's streams advance now (`streams_now_itl`; 0 with no stream)."""
    return streams_now_itl(view.now_itl_s, costs, view.running_decodes) or 0.0


def stretched_step(overhead_s: float, per_decode_s: float, streams: int, prefill_share: float) -> float:
    """The ITL of `streams` streams on an instance that spends `prefill_share` of its time in
    steps with prompt tokens: their decode step, stretched by those steps."""
    return (overhead_s + per_decode_s * streams) / max(1.0 - prefill_share, 1.0 / MAX_STRETCH)


def prefill_streams_itl(load: PrefillLoad, costs: Coefficients) -> float:
    """How slowly P's streams advance now: D's fitted decode step for them (like cores), stretched
    by the share of P's time its prefill steps take."""
    if load.decodes <= 0:
        return 0.0
    return stretched_step(costs.overhead_s, costs.per_decode_s, load.decodes, load.prefill_share)


def local_is_lighter(tokens: int, view, load: PrefillLoad, costs: Coefficients, queued_on_p: int) -> bool:
    """Whether D's streams, with this prompt prefilled on D, advance no slower than P's would
    with it prefilled on P. `view` is D's DecodeView, `costs` D's step costs, `queued_on_p` the
    prompt tokens P has left to compute."""
    spread = view.stream_tokens if view.stream_tokens > 0 else 0.0
    added_local = costs.per_prefill_token_s * (view.local_backlog_tokens + tokens) / spread if spread else 0.0
    added_remote = load.per_token_s * (queued_on_p + tokens) / spread if spread else 0.0
    local = decode_streams_itl(view, costs) + added_local
    remote = prefill_streams_itl(load, costs) + added_remote
    return local <= remote


__all__ = ["RESPONSE_STRETCH", "decode_streams_itl", "local_is_lighter", "prefill_streams_itl", "streams_now_itl",
           "stretched_step"]
