"""Per-request placement: where each prompt is prefilled, on P (remote) or on D itself (local).

Free of vLLM and of the connector: the connector's scheduler and worker sides feed it step
timings, loads and statuses, and call `PlacementPolicy.decide`. A new policy is a new class in
policy.py with that method.

This module is placement's interface: the connector imports placement only from here (an
import-linter contract checks it), so what it exports below is all the connector may use. The
modules behind it:

- config.py: `PlacementConfig`, the placement keys of kv_connector_extra_config, parsed once
- slo_targets.py: the bounds placement protects, read from a declared SLO
- decision.py: `Placement`, `Reason` and `Decision`, what a policy answers
- policy.py: `DecodeView` (D's side of a decision) and the policies, `StaticPolicy` and `AdaptivePolicy`
- balance.py: the rule while P decodes streams of its own (serve_decode)
- step_costs.py: an instance's step cost model, fitted from the steps it ran
- chunk_size.py: how many prompt tokens a step beside running streams may compute
- chunk_costs.py: what a prompt token adds to such a step, learnt from them
- chunk_headroom.py: how full of its bound such a step is planned, learnt from them
- remote_path.py: a remote prompt's TTFT beyond P's compute, learnt on D
- decode_load.py: `DecodeLoad`, D's bookkeeping of its own load and its prefill instances'
- prefill_share.py: P's share of time in prefill steps (published in its load)
- messages.py: the wire messages `PrefillLoad` (P -> D) and `DecodeStatus` (D -> P)
- status_view.py: a `DecodeView` as a `DecodeStatus` and back
- inbox.py: `PlacementInbox`, the worker thread's side, and the `WorkerNews` it hands the scheduler
- prefill_gate.py: P, WRITE: a prefill leg waits for D's decision
- read_mode.py: P, READ: P decides each leg's placement from D's published status
- serve_gate.py: P with serve_decode: whether it offers itself as a decode instance now
"""

from pdserve.placement.chunk_costs import ChunkCosts
from pdserve.placement.chunk_size import MIN_CHUNK, OVER, WITHIN, chunk_tokens, threshold
from pdserve.placement.decision import Decision, Placement, Reason
from pdserve.placement.decode_load import DecodeLoad, uncomputed_prompt_tokens
from pdserve.placement.inbox import PUBLISH_EVERY_S, PlacementInbox, WorkerNews
from pdserve.placement.messages import MAX_COUNTED_TRANSFERS, MAX_PREFILL_PEERS, DecodeStatus, PrefillLoad
from pdserve.placement.policy import AdaptivePolicy, PlacementPolicy, make_policy
from pdserve.placement.prefill_gate import PrefillGate, Verdict
from pdserve.placement.prefill_share import PrefillShare
from pdserve.placement.read_mode import ReadPlacement, next_step_seconds, peer_key
from pdserve.placement.serve_gate import STATUS_EVERY_S, ServeGate
from pdserve.placement.status_view import status_of
from pdserve.placement.step_costs import StepCosts

__all__ = [
    # the policies and what they answer
    "PlacementPolicy", "AdaptivePolicy", "make_policy", "Decision", "Placement", "Reason",
    # D: its load; P: its gate (WRITE), its placement (READ), its decode offer (serve_decode)
    "DecodeLoad", "uncomputed_prompt_tokens", "PrefillGate", "Verdict", "ReadPlacement", "next_step_seconds",
    "peer_key", "ServeGate",
    # the step cost models and the chunk beside running streams
    "StepCosts", "ChunkCosts", "PrefillShare", "chunk_tokens", "threshold", "MIN_CHUNK", "OVER", "WITHIN",
    # the wire messages, the worker thread's inbox and how often each side publishes
    "PrefillLoad", "DecodeStatus", "status_of", "PlacementInbox", "WorkerNews", "PUBLISH_EVERY_S",
    "STATUS_EVERY_S", "MAX_COUNTED_TRANSFERS", "MAX_PREFILL_PEERS",
]
