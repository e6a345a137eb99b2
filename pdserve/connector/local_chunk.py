"""LocalChunk: how many tokens of a prompt D computes in one step when it prefills the prompt itself.

The chunk follows D's running streams instead of being fixed at launch:

* with no stream running, nobody waits on the step, so a prompt takes up to the cap (the whole
  prompt, for the usual cap) in one step: D prefills as fast as P would;
* with streams running, it is the largest chunk whose step, by D's measured step costs
  (`Coefficients`), stays within STEP_HEADROOM x `max_step_s`, so a local prefill does not make a
  running stream wait longer than `max_step_s` for its next token (the headroom absorbs the steps
  that run slower than the estimate: on a 2-core EPYC, 10-30% of chunk steps did at 1.0). Several local prompts in progress share it (vLLM gives each
  prompt up to the threshold, so the threshold is the chunk divided among them).

`PDScheduler` applies the result as vLLM's ``long_prefill_token_threshold`` before each step;
`AdaptivePolicy` estimates a local prefill's TTFT with the same numbers. Free of vLLM.
"""

from __future__ import annotations

import math

from pdserve.connector.step_costs import Coefficients

MIN_CHUNK = 16  # one KV block: below this a chunk step is mostly fixed overhead, so D does not prefill locally
STEP_HEADROOM = 0.8  # of max_step a chunk step is sized to


def chunk_tokens(costs: Coefficients | None, decodes: int, max_step_s: float, cap: int) -> int:
    """Tokens of local prefill D's next step may compute in all, with `decodes` streams in it
    (0: a step within `max_step_s` leaves no room for prefill)."""
    if decodes <= 0 or math.isinf(max_step_s):
        return cap  # nobody waits on the step, or no bound on it (a declared SLO without max_gap)
    if costs is None or costs.per_prefill_token_s <= 0:
        return 0  # no measured cost yet: no bound can be kept
    room = (STEP_HEADROOM * max_step_s - costs.step_seconds(0, decodes)) / costs.per_prefill_token_s
    return max(0, min(cap, int(room + 1e-9)))  # 1e-9: 0.04 / 0.001 is 39.99...


def threshold(chunk: int, prompts_in_progress: int) -> int:
    """vLLM's per-prompt limit for a step when `prompts_in_progress` local prompts share `chunk`
    (never below MIN_CHUNK: a prompt D took always progresses)."""
    return max(MIN_CHUNK, chunk // max(1, prompts_in_progress))


__all__ = ["MIN_CHUNK", "STEP_HEADROOM", "chunk_tokens", "threshold"]
