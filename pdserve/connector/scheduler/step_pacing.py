"""The step pacers: an instance's step clock, the step costs it learns from it, and the per-prompt
prefill limit it sets for vLLM's next step (adaptive placement). One class per role:
`PrefillPacer` (P) and `DecodePacer` (D), over what they share in `StepPacer`.

The scheduler side starts a step in `build_connector_meta` and ends it in
`update_connector_output`; the step's time, prompt tokens and decodes feed the cost models
(placement/step_costs.py, and on D decode_load.py). On an instance that decodes beside prompts
(D; P with serve_decode) the next step's limit keeps those prompts from stretching a step past
max_step_ms (placement/chunk_size.py).
"""

from __future__ import annotations

import math
import time
from typing import Callable

from pdserve.config import ConnectorConfig
from pdserve.connector.metadata import StepPlan
from pdserve.placement import (
    MIN_CHUNK,
    AdaptivePolicy,
    ChunkCosts,
    DecodeLoad,
    PlacementPolicy,
    PrefillShare,
    StepCosts,
    chunk_tokens,
    threshold,
)


class StepPacer:
    """What both roles' pacers share: the step clock, and the limit set through `set_chunk`."""

    def __init__(self, config: ConnectorConfig, budget: int, policy: PlacementPolicy, decode_load: DecodeLoad,
                 set_chunk: Callable[[int], None] | None, plan: Callable[[], StepPlan]):
        self._config = config
        self._budget = budget  # this instance's --max-num-batched-tokens
        self._policy = policy
        self._load = decode_load
        self._set_chunk = set_chunk  # sets vLLM's per-prompt prefill limit for the next step
        self._plan = plan  # the StepPlan being built
        self.chunk_limit: int | None = None  # the limit last set
        self._step: tuple[float, int, int, int] | None = None  # this step's start, prefill tokens, decodes, streams

    @property
    def _adaptive(self) -> bool:
        return self._set_chunk is not None and isinstance(self._policy, AdaptivePolicy)

    def start(self, num_scheduled_tokens: dict[str, int], streams: int | None, prompts: int) -> None:
        """A step starts: `streams` are the requests it gives a generated token that this instance
        decodes (None: every one-token request); `prompts` the prompts P computes at a time."""
        prefill = sum(n for n in num_scheduled_tokens.values() if n > 1)
        decodes = sum(1 for n in num_scheduled_tokens.values() if n == 1)
        self._load.running_decodes = self._load.streams_after(num_scheduled_tokens)
        streams = decodes if streams is None else streams
        self._step = (time.monotonic(), prefill, decodes, streams) if prefill or decodes else None
        self._started()
        if self._adaptive and self._apply_chunk(streams, prompts):
            self._set_chunk(self.chunk_limit)

    def end(self) -> None:
        """The step's output arrived: its time feeds the cost models and the chunk-step counts."""
        if self._step is None:
            return
        started, prefill, decodes, streams = self._step
        self._step = None
        self._ended(started, time.monotonic() - started, prefill, decodes, streams)

    def shorten_for_first_tokens(self, landed: int) -> None:
        """D: requests whose KV just landed take their first token in the next step."""

    def _started(self) -> None:
        """A step started (before its chunk is applied)."""

    def _apply_chunk(self, streams: int, prompts: int) -> bool:
        """Adaptive: set `chunk_limit` for the next step from the streams of this one; whether it was set."""
        raise NotImplementedError

    def _ended(self, started: float, took: float, prefill: int, decodes: int, streams: int) -> None:
        raise NotImplementedError


class PrefillPacer(StepPacer):
    """P: its step costs and its share of time in prefill steps (published in its load), and with
    serve_decode the limit that keeps the prompts it prefills from stretching its streams' steps."""

    def __init__(self, config: ConnectorConfig, budget: int, policy: PlacementPolicy, decode_load: DecodeLoad,
                 set_chunk: Callable[[int], None] | None, plan: Callable[[], StepPlan]):
        super().__init__(config, budget, policy, decode_load, set_chunk, plan)
        self.costs = StepCosts()
        # with serve_decode: a prompt token's cost in its chunk steps beside its own streams (chunk_costs.py)
        serves = config.placement.adaptive and config.placement.serve_decode
        self.chunk_costs = ChunkCosts() if serves else None
        self.prefill_share = PrefillShare()  # its time in prefill steps (published in its load, serve_gate.py)
        self.step_prefill = budget  # prompt tokens its next step computes at most (published to D)

    def _apply_chunk(self, streams: int, prompts: int) -> bool:
        """With serve_decode: the prompts P prefills never stretch a step of its own streams past
        max_step_ms."""
        if self.chunk_costs is None:
            return False
        learnt = self.chunk_costs
        chunk = chunk_tokens(learnt.costs(self.costs.coefficients()), streams,
                             self._config.placement.max_step_ms / 1000, self._budget,
                             headroom=learnt.headroom.headroom())
        self.chunk_limit = threshold(chunk, prompts) if streams else self._budget
        self.step_prefill = max(MIN_CHUNK, chunk) if streams else self._budget
        return True

    def _ended(self, started: float, took: float, prefill: int, decodes: int, streams: int) -> None:
        self.costs.observe(took, prefill, decodes)
        self.prefill_share.on_step(started, took, prefill, streams)
        if streams and self.chunk_costs is not None:  # a step whose chunk _apply_chunk sized
            self.chunk_costs.on_step(took, self.costs, decodes, prefill)
            if prefill >= MIN_CHUNK:  # on /metrics as D's are: did P's streams wait past the bound?
                bound = self._config.placement.max_step_ms / 1000
                self._plan().chunk_steps_over.append(took > bound)


class DecodePacer(StepPacer):
    """D: its local prompts (one computed at a time: decode_receive.py) never stretch a step past
    max_step_ms; its step costs are in decode_load."""

    def __init__(self, config: ConnectorConfig, budget: int, policy: PlacementPolicy, decode_load: DecodeLoad,
                 set_chunk: Callable[[int], None] | None, plan: Callable[[], StepPlan]):
        super().__init__(config, budget, policy, decode_load, set_chunk, plan)
        self._landing = (False, False)  # (the next step's, this step's) chunk sized for first tokens of landed requests

    def _started(self) -> None:
        self._landing = (False, self._landing[0])

    def _apply_chunk(self, streams: int, prompts: int) -> bool:
        self.chunk_limit = self._local_chunk_limit()
        return True

    def shorten_for_first_tokens(self, landed: int) -> None:
        """Requests whose KV just landed take their first token in the next step, so a local chunk
        in it is sized to a stream's step (`landing_step_s`), not the response bound: their TTFT is
        P's prefill plus that step. Set after the step's output, before vLLM schedules the next one
        (placement/chunk_size.py)."""
        if not self._adaptive or not self._load.local_prompts():
            return
        self.chunk_limit = min(self.chunk_limit or self._budget, self._local_chunk_limit(landed))
        self._landing = (True, self._landing[1])
        self._set_chunk(self.chunk_limit)

    def _local_chunk_limit(self, landed: int = 0) -> int:
        """vLLM's per-prompt limit for its next step, the whole local chunk, with `landed` first
        tokens in the step."""
        view, some = self._load.view(None), self._load.some_load()
        return threshold(self._policy.chunk(view, self._policy.local_costs(view, some), some, landed), 1)

    def _ended(self, started: float, took: float, prefill: int, decodes: int, streams: int) -> None:
        self._load.costs.observe(took, prefill, decodes)
        self._load.on_step(took, decodes, prefill)
        self._judge_chunk_step(took, prefill, decodes)
        self._plan().remote_paths.extend(self._load.remote_path.step_ended())

    def _judge_chunk_step(self, took: float, prefill: int, decodes: int) -> None:
        """Whether a step with a local chunk kept the bound its chunk was sized for (on /metrics:
        how often a local prefill made streams wait past max_step_ms)."""
        if prefill < MIN_CHUNK or not isinstance(self._policy, AdaptivePolicy):
            return
        bound = self._policy.step_bound(decodes, self._load.some_load(), self._landing[1])
        if math.isfinite(bound):
            self._plan().chunk_steps_over.append(took > bound)
