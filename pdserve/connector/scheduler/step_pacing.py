"""StepPacer: an instance's step clock, the step costs it learns from it, and the per-prompt
prefill limit it sets for vLLM's next step (adaptive placement).

PDScheduler starts a step in `build_connector_meta` and ends it in `update_connector_output`; the
step's time, prompt tokens and decodes feed the cost models (placement/step_costs.py, and on D
decode_load.py). On an instance that decodes beside prompts (D; P with serve_decode) the next
step's limit keeps those prompts from stretching a step past max_step_ms (placement/chunk_size.py).
"""

from __future__ import annotations

import math
import time
from typing import Callable

from pdserve.config import ConnectorConfig, Role
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
    def __init__(self, config: ConnectorConfig, budget: int, policy: PlacementPolicy, decode_load: DecodeLoad,
                 set_chunk: Callable[[int], None] | None, plan: Callable[[], StepPlan]):
        self._config = config
        self._budget = budget  # this instance's --max-num-batched-tokens
        self._policy = policy
        self._load = decode_load
        self._set_chunk = set_chunk  # sets vLLM's per-prompt prefill limit for the next step
        self._plan = plan  # the StepPlan being built
        self.costs = StepCosts()  # P's step costs (D's are in decode_load)
        # P with serve_decode: a prompt token's cost in its chunk steps beside its own streams (chunk_costs.py)
        serves = config.placement.adaptive and config.placement.serve_decode and config.role is Role.PRODUCER
        self.chunk_costs = ChunkCosts() if serves else None
        self.prefill_share = PrefillShare()  # P: its time in prefill steps (published in its load, serve_gate.py)
        self.chunk_limit: int | None = None  # the limit last set
        self.step_prefill = budget  # P: prompt tokens its next step computes at most (published to D)
        self._step: tuple[float, int, int, int] | None = None  # this step's start, prefill tokens, decodes, streams
        self._landing = (False, False)  # D: (the next step's, this step's) chunk sized for first tokens of landed requests

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
        self._landing = (False, self._landing[0])
        self._apply_chunk(streams, prompts)

    def _apply_chunk(self, streams: int, prompts: int) -> None:
        """The next step's limit on one prompt's prefill tokens, from the streams of this one, on an
        instance that decodes: D (its local prompts never stretch a step past max_step_ms) and, with
        serve_decode, P (the prompts it prefills never stretch a step of its own streams past it)."""
        if not self._adaptive:
            return
        if self._config.role is Role.CONSUMER:
            self.chunk_limit = self._local_chunk_limit()
        elif self.chunk_costs is not None:
            learnt = self.chunk_costs
            chunk = chunk_tokens(learnt.costs(self.costs.coefficients()), streams,
                                 self._config.placement.max_step_ms / 1000, self._budget,
                                 headroom=learnt.headroom.headroom())
            self.chunk_limit = threshold(chunk, prompts) if streams else self._budget
            self.step_prefill = max(MIN_CHUNK, chunk) if streams else self._budget
        else:
            return
        self._set_chunk(self.chunk_limit)

    def shorten_for_first_tokens(self, landed: int) -> None:
        """D: requests whose KV just landed take their first token in the next step, so a local
        chunk in it is sized to a stream's step (`landing_step_s`), not the response bound: their
        TTFT is P's prefill plus that step. Set after the step's output, before vLLM schedules the
        next one (placement/chunk_size.py)."""
        if not self._adaptive or self._config.role is not Role.CONSUMER or not self._load.local_prompts():
            return
        self.chunk_limit = min(self.chunk_limit or self._budget, self._local_chunk_limit(landed))
        self._landing = (True, self._landing[1])
        self._set_chunk(self.chunk_limit)

    def _local_chunk_limit(self, landed: int = 0) -> int:
        """D: vLLM's per-prompt limit for its next step, the whole local chunk (one local prompt
        computes at a time: decode_receive.py), with `landed` first tokens in the step."""
        view, some = self._load.view(None), self._load.some_load()
        return threshold(self._policy.chunk(view, self._policy.local_costs(view, some), some, landed), 1)

    def end(self) -> None:
        """The step's output arrived: its time feeds the cost models and the chunk-step counts."""
        if self._step is None:
            return
        started, prefill, decodes, streams = self._step
        self._step = None
        took = time.monotonic() - started
        if self._config.role is Role.CONSUMER:
            self._load.costs.observe(took, prefill, decodes)
            self._load.on_step(took, decodes, prefill)
            self._judge_chunk_step(took, prefill, decodes)
            self._plan().remote_paths.extend(self._load.remote_path.step_ended())
            return
        self.costs.observe(took, prefill, decodes)
        self.prefill_share.on_step(started, took, prefill, streams)
        if streams and self.chunk_costs is not None:  # a step whose chunk _apply_chunk sized
            self.chunk_costs.on_step(took, self.costs, decodes, prefill)
            if prefill >= MIN_CHUNK:  # on /metrics as D's are: did P's streams wait past the bound?
                bound = self._config.placement.max_step_ms / 1000
                self._plan().chunk_steps_over.append(took > bound)

    def _judge_chunk_step(self, took: float, prefill: int, decodes: int) -> None:
        """D: whether a step with a local chunk kept the bound its chunk was sized for (on
        /metrics: how often a local prefill made streams wait past max_step_ms)."""
        if prefill < MIN_CHUNK or not isinstance(self._policy, AdaptivePolicy):
            return
        bound = self._policy.step_bound(decodes, self._load.some_load(), self._landing[1])
        if math.isfinite(bound):
            self._plan().chunk_steps_over.append(took > bound)
