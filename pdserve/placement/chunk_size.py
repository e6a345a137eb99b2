"""Chunk size: how many tokens of a prompt D computes in one step when it prefills the prompt itself.

The chunk follows D's running streams instead of being fixed at launch:

* with streams running, it is the largest chunk whose step, by D's measured step costs
  (`Coefficients`), stays within a headroom x `max_step_s`, so a local prefill does not make a
  running stream wait longer than `max_step_s` for its next token (the headroom absorbs the steps
  that run slower than the estimate; D learns it from its own chunk steps, chunk_headroom.py, and
  starts from STEP_HEADROOM);
* whether streams run or not, no step is longer than `response_s` either: D decides where a new
  request is prefilled, and gives a request whose KV just landed its first token, only between
  steps, so a whole long prompt in one step would hold both back by that step's length while P
  may sit idle. The bound costs a local prefill one step overhead per extra chunk;
* a step in which requests whose KV just landed take their first token is a stream's step
  (`PlacementConfig.landing_step_s`: `max_step_s`, or the mean ITL target where no max gap is
  bounded): D usually prefills a prompt itself while P is busy with another, whose KV then lands
  during D's chunks, and a response-bound chunk step would add its length to that request's TTFT.
  The scheduler sizes it after the step's output reports the landing, before vLLM schedules the
  next one;
* with neither bound (no stream, and no response bound), a prompt takes up to the cap (the whole
  prompt, for the usual cap) in one step.

D prefills its own prompts one at a time, in the order it took them (the scheduler holds a later
one until the earlier is computed), so one prompt takes the whole chunk; P, which serves whole
requests beside D's legs with serve_decode, shares its chunk among its prompts (vLLM gives each
prompt up to the threshold, so there the threshold is the chunk divided among them).

`PDScheduler` applies the result as vLLM's ``long_prefill_token_threshold`` before each step;
`AdaptivePolicy` estimates a local prefill's TTFT with the same numbers. Free of vLLM.
"""

from __future__ import annotations

import math

from pdserve.placement.step_costs import Coefficients

MIN_CHUNK = 16  # one KV block: below this a chunk step is mostly fixed overhead, so D does not prefill locally
STEP_HEADROOM = 0.8  # of its bound a chunk step is sized to, until D has measured its own (chunk_headroom.py)
WITHIN, OVER = "within", "over"  # whether a chunk step kept its bound (pdserve:local_chunk_steps_total{bound})


def step_bound(decodes: int, max_step_s: float, response_s: float = math.inf) -> float:
    """The longest a step with `decodes` streams and a local chunk may take (inf: no bound)."""
    return min(max_step_s if decodes > 0 else math.inf, response_s)


def chunk_tokens(costs: Coefficients | None, decodes: int, max_step_s: float, cap: int,
                 response_s: float = math.inf, headroom: float = STEP_HEADROOM) -> int:
    """Tokens of local prefill D's next step may compute in all, with `decodes` streams in it
    (0: a step within `max_step_s` leaves no room for prefill). `response_s` bounds every step,
    streams or not; with no stream it never stops a prompt (at least MIN_CHUNK). The step is sized
    to `headroom` x its bound by `costs` (chunk_headroom.py learns it on D)."""
    bound = step_bound(decodes, max_step_s, response_s)
    if math.isinf(bound):
        return cap  # nobody waits on the step, or no bound on it (a declared SLO without max_gap)
    if costs is None or costs.per_prefill_token_s <= 0:
        return 0 if decodes > 0 else cap  # no measured cost yet: no bound can be kept
    room = (headroom * bound - costs.step_seconds(0, decodes)) / costs.per_prefill_token_s
    chunk = max(0, min(cap, int(room + 1e-9)))  # 1e-9: 0.04 / 0.001 is 39.99...
    return chunk if decodes > 0 else min(cap, max(MIN_CHUNK, chunk))


def threshold(chunk: int, prompts_in_progress: int) -> int:
    """vLLM's per-prompt limit for a step when `prompts_in_progress` local prompts share `chunk`
    (never below MIN_CHUNK: a prompt D took always progresses)."""
    return max(MIN_CHUNK, chunk // max(1, prompts_in_progress))


__all__ = ["MIN_CHUNK", "OVER", "STEP_HEADROOM", "WITHIN", "chunk_tokens", "step_bound", "threshold"]
