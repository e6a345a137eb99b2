"""ChunkCosts: what a prompt token adds to a step that also decodes streams, learnt from such steps.

An instance that prefills a prompt in chunks beside its streams (D for its local prompts, P for
what it prefills while it serves requests whole) sizes each chunk from its step costs so that the
step stays within its bound (chunk_size.py). The step cost fit (step_costs.py) is a poor guide for
those steps: on P it is fitted mostly on whole-prompt steps, where a token costs less than in a
small chunk beside decodes, so chunk steps planned from the fit alone overrun their bound.

So each such step teaches two things: what a prompt token added to it beyond its decodes' share
of the fit (an EWMA), and how far it ran from what that measure predicted (chunk_headroom.py: the
share of its bound the next chunk step is planned to fill). Free of vLLM.
"""

from __future__ import annotations

from pdserve.placement.chunk_headroom import ChunkHeadroom
from pdserve.placement.chunk_size import MIN_CHUNK
from pdserve.placement.step_costs import Coefficients, StepCosts

CHUNK_WEIGHT = 0.2  # of each chunk step in the measured cost of a prompt token


class ChunkCosts:
    def __init__(self):
        self.headroom = ChunkHeadroom()  # how full of its bound a chunk step is planned
        self.prefill_token_s: float | None = None  # what a prompt token added to chunk steps (EWMA)

    def on_step(self, seconds: float, costs: StepCosts, decodes: int, prefill_tokens: int) -> None:
        """A finished step that took `seconds`, gave `decodes` requests a token each and computed
        `prefill_tokens` prompt tokens; `costs` is the instance's step cost fit. Steps with less
        than one chunk's worth of prompt tokens teach nothing (the fit trims rare slow steps)."""
        if prefill_tokens < MIN_CHUNK or seconds < 0:
            return
        base = costs.coefficients()
        if base is None:
            return
        decode_share = base.step_seconds(0, decodes)
        if self.prefill_token_s is not None:
            self.headroom.observe(seconds, decode_share + self.prefill_token_s * prefill_tokens)
        per_token = max(0.0, seconds - decode_share) / prefill_tokens
        self.prefill_token_s = per_token if self.prefill_token_s is None else (
            self.prefill_token_s + CHUNK_WEIGHT * (per_token - self.prefill_token_s))

    def costs(self, base: Coefficients | None) -> Coefficients | None:
        """`base` with a prompt token costing what chunk steps measured, never less than the fit's."""
        if base is None or self.prefill_token_s is None:
            return base
        return Coefficients(base.overhead_s, max(self.prefill_token_s, base.per_prefill_token_s), base.per_decode_s)


__all__ = ["CHUNK_WEIGHT", "ChunkCosts"]
