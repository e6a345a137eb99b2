"""Per-request placement: where each prompt is prefilled, on P (remote) or on D itself (local).

Free of vLLM and of the connector: the connector's scheduler and worker halves feed it step
timings, loads and statuses, and call `PlacementPolicy.decide`. A new policy is a new class in
policy.py with that method. The modules:

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
