"""Per-request placement: prefill on P and decode on D (remote), or prefill on D itself (local).

Decided by D's scheduler when a request's decode leg first asks for its KV (WRITE mode; in READ
mode by P when the prefill leg arrives, with D's view as D publishes it: read_mode.py), from
the request's uncached prompt length and live load: P's published queue (a `PrefillLoad`, sent by
P over the control plane) and D's own running decodes and local prefill backlog (`DecodeView`).
The scheduler calls `decide`; a new policy is a new class with that method here. Free of vLLM.

While P has nothing queued the prompt goes to P (`prefill_idle`): P starts it at once, and D stays
free to decide the next request and to give landed requests their first token, which a local
prefill step would hold back.
Otherwise `AdaptivePolicy` estimates the TTFT of each placement from measured step costs (a remote
one also from the path around P's compute that D measured, remote_path.py) and picks
the smaller one, within two bounds that protect D's running streams (that is what disaggregation is for):

* mean ITL (`itl_target_ms`, what the usual SLOs bound): a stream of L tokens sees every prompt
  token D computes while it runs, so this prompt and D's local backlog add about
  per_token x tokens / L to its mean ITL. A local prefill is allowed while the mean ITL D's streams
  saw over the last stream lifetime plus that stays within ITL_HEADROOM x the target. Measured, not
  modelled, so it follows what D's local prefills already cost: as D takes more of them its
  streams' ITL rises (decode_step / (1 - prefill share)) until the guard stops adding more.
* one step (`max_step_ms`, what max-gap / stall SLOs bound): while D decodes, its local prefill runs
  in chunks no step of which takes longer (`chunk_size.py`: the chunk follows D's streams, the whole
  prompt when none runs). The default is the ITL target's default: a local prefill never makes a
  stream wait longer than one target ITL for a token.

A declared SLO (`slo`, slo_targets.py) sets both bounds instead: its mean ITL bound, and its max-gap
bound or none, so under a mean-ITL SLO D prefills a prompt beside its streams in chunks only the
response bound (below) limits, much as plain serving prefills it whole, where P's queue makes
that faster. Its TTFT bound adds a third rule: a prompt P serves within TTFT_HEADROOM x the bound
goes to P even where D would be faster, so D spends its streams' ITL budget only on the prompts P
cannot serve in time; and where P would miss the bound and D would meet it, the ITL guard allows
the streams' whole target instead of ITL_HEADROOM of it (`ttft_rescue`): a certain TTFT miss
outweighs the guard's margin.

While P decodes streams of its own (`serve_decode`, serve_gate.py) neither side's time is free,
and the rules above, which spend P's time to spare D's streams, give way to `balance` (balance.py):
the prompt goes to the side whose streams advance faster with it counted, as plain serving on two
instances prefills each prompt beside its own streams; the step guard and the declared TTFT bound
still hold.

`StaticPolicy` always disaggregates.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Protocol

from pdserve.placement.balance import RESPONSE_STRETCH, local_is_lighter
from pdserve.placement.chunk_size import MIN_CHUNK, STEP_HEADROOM, chunk_tokens, step_bound
from pdserve.placement.config import PlacementConfig
from pdserve.placement.decision import Decision, Placement, Reason
from pdserve.placement.messages import PrefillLoad
from pdserve.placement.step_costs import Coefficients

ITL_HEADROOM = 0.9  # of the mean-ITL allowance a local prefill may use: streams differ from the mean
DEFAULT_PATH_MS = 20.0  # the remote path until D measured its own: router hop, transfer and D's first step
TTFT_HEADROOM = 0.8  # of the TTFT target P's estimate must stay within: the estimate leaves out the client's hops


def drain_seconds(load: PrefillLoad, tokens: int) -> float:
    """How long P takes to compute `tokens` prompt tokens, `load.budget` per step."""
    steps = math.ceil(tokens / load.budget) if tokens > 0 else 0
    return steps * load.overhead_s + tokens * load.per_token_s


@dataclass(frozen=True)
class DecodeView:
    """D's side of the decision."""

    running_decodes: int
    local_backlog_tokens: int  # prompt tokens D decided to prefill itself and has not computed yet
    remote_outstanding_tokens: int  # prompt tokens D sent to this P that no load of P's counted yet
    budget: int  # D's --max-num-batched-tokens: decodes and local chunks share it
    costs: Coefficients | None
    knows_prefill: bool
    recent_itl_s: float | None = None  # mean ITL of D's streams over a stream's life (None: not measured)
    stream_tokens: float = 0.0  # mean output tokens of D's finished requests (0: none finished yet)
    chunk: int = 0  # the most tokens of local prefill D computes in a step, the cap of chunk_size.py (0: budget)
    prefill_token_s: float | None = None  # what one prompt token added to D's chunk steps, measured (None: none yet)
    now_itl_s: float | None = None  # mean ITL of D's streams over the last few seconds (None: no token in them)
    chunk_headroom: float = STEP_HEADROOM  # of its bound a local chunk step is planned to fill (chunk_headroom.py)
    remote_path_s: float | None = None  # a remote TTFT beyond P's compute, measured (remote_path.py; None: not yet)


class PlacementPolicy(Protocol):
    def decide(self, uncached_tokens: int, view: DecodeView, load: PrefillLoad | None,
               local_delay_s: float = 0.0) -> Decision: ...


class StaticPolicy:
    def decide(self, uncached_tokens: int, view: DecodeView, load: PrefillLoad | None,
               local_delay_s: float = 0.0) -> Decision:
        return Decision(Placement.REMOTE, Reason.STATIC)


class AdaptivePolicy:
    def __init__(self, config: PlacementConfig, clock=time.time):
        self._config = config
        self._clock = clock

    def decide(self, uncached_tokens: int, view: DecodeView, load: PrefillLoad | None,
               local_delay_s: float = 0.0) -> Decision:
        """`local_delay_s`: what a local prefill waits for before D can start it (READ: the dropped
        leg's one-token step on P, read_mode.py)."""
        if uncached_tokens > self._config.max_local_tokens:
            return Decision(Placement.REMOTE, Reason.LONG_PROMPT)
        local_costs = self.local_costs(view, load)
        if local_costs is None or load is None and not view.knows_prefill:
            return Decision(Placement.REMOTE, Reason.WARMING_UP)
        if load is not None and load.decodes > 0:
            return self._balance(uncached_tokens, view, load, local_costs, local_delay_s)
        if load is not None and self._queued(view, load) == 0:  # P starts it at once; D stays free
            return Decision(Placement.REMOTE, Reason.PREFILL_IDLE, None,
                            self._remote_ttft(uncached_tokens, view, load, local_costs),
                            self._compute(uncached_tokens, view, load, local_costs))
        remote = self._remote_ttft(uncached_tokens, view, load, local_costs)
        compute = self._compute(uncached_tokens, view, load, local_costs)
        chunk = self.chunk(view, local_costs)
        if chunk < MIN_CHUNK:
            return Decision(Placement.REMOTE, Reason.STEP_GUARD, None, remote, compute)
        local = local_delay_s + self._local_ttft(uncached_tokens, view, local_costs, chunk)
        if local >= remote:
            return Decision(Placement.REMOTE, Reason.REMOTE_FASTER, local, remote, compute)
        if math.isfinite(self._config.ttft_target_ms) and remote <= TTFT_HEADROOM * self._config.ttft_target_ms / 1000:
            return Decision(Placement.REMOTE, Reason.WITHIN_TTFT, local, remote, compute)
        if view.running_decodes > 0 and not self._within_itl(uncached_tokens, view, local_costs, ITL_HEADROOM):
            target_s = self._config.ttft_target_ms / 1000
            if remote > target_s >= local and self._within_itl(uncached_tokens, view, local_costs, 1.0):
                return Decision(Placement.LOCAL, Reason.TTFT_RESCUE, local, remote, compute)
            return Decision(Placement.REMOTE, Reason.ITL_GUARD, local, remote, compute)
        return Decision(Placement.LOCAL, Reason.LOCAL_FASTER, local, remote, compute)

    def _balance(self, tokens: int, view: DecodeView, load: PrefillLoad, costs: Coefficients,
                 local_delay_s: float) -> Decision:
        """While P decodes streams of its own (balance.py): the side whose streams advance faster
        with the prompt, unless that side misses the declared TTFT bound and the other meets it."""
        queued = self._queued(view, load)
        remote = self._remote_ttft(tokens, view, load, costs)
        remote += math.ceil((queued + tokens) / load.budget) * costs.per_decode_s * load.decodes  # P's steps decode too
        compute = remote - self._path_s(view)
        chunk = self.chunk(view, costs, load)
        if chunk < MIN_CHUNK:
            return Decision(Placement.REMOTE, Reason.STEP_GUARD, None, remote, compute)
        local = local_delay_s + self._local_ttft(tokens, view, costs, chunk)
        target_s = self._config.ttft_target_ms / 1000
        if local_is_lighter(tokens, view, load, costs, queued):
            if local > target_s >= remote:
                return Decision(Placement.REMOTE, Reason.REMOTE_FASTER, local, remote, compute)
            return Decision(Placement.LOCAL, Reason.BALANCE, local, remote, compute)
        if remote > target_s >= local:
            return Decision(Placement.LOCAL, Reason.LOCAL_FASTER, local, remote, compute)
        return Decision(Placement.REMOTE, Reason.BALANCE, local, remote, compute)

    def chunk(self, view: DecodeView, costs: Coefficients | None, load: PrefillLoad | None = None,
              landed: int = 0) -> int:
        """Local prefill tokens D's next step may compute (chunk_size.py), within its budget; a
        longer step while P (`load`) decodes streams too (balance.py), a shorter one while `landed`
        requests whose KV just landed take their first token in it."""
        decodes = view.running_decodes + landed
        cap = min(view.chunk or view.budget, max(0, view.budget - decodes))
        return chunk_tokens(costs, decodes, self._config.max_step_ms / 1000, cap,
                            self._response_s(load, landed > 0), view.chunk_headroom)

    def step_bound(self, decodes: int, load: PrefillLoad | None, landed: bool = False) -> float:
        """The longest a step of D with `decodes` streams and a local chunk may take (inf: none);
        `landed`: first tokens of requests whose KV just landed are in it."""
        return step_bound(decodes, self._config.max_step_ms / 1000, self._response_s(load, landed))

    def _response_s(self, load: PrefillLoad | None, landed: bool = False) -> float:
        response = self._config.response_step_s * (RESPONSE_STRETCH if load is not None and load.decodes > 0 else 1)
        return min(response, self._config.landing_step_s) if landed else response

    def _within_itl(self, tokens: int, view: DecodeView, costs: Coefficients, headroom: float) -> bool:
        """Whether D's running streams keep their mean ITL under the target with this prompt
        prefilled here too (see the module docstring)."""
        if view.stream_tokens <= 0:
            return False  # no stream has finished: how many tokens a stream shares the delay over is unknown
        itl = view.recent_itl_s if view.recent_itl_s is not None else costs.step_seconds(0, view.running_decodes + 1)
        added = costs.per_prefill_token_s * (view.local_backlog_tokens + tokens) / view.stream_tokens
        return itl + added <= headroom * self._config.itl_target_ms / 1000

    def local_costs(self, view: DecodeView, load: PrefillLoad | None) -> Coefficients | None:
        """D's step costs; a prompt token costs what it measured in its own chunk steps (never less
        than on P, which computes whole prompts), and until D has prefilled anything itself, what it
        costs on P."""
        if view.costs is None:
            return None
        if view.prefill_token_s is not None:
            floor = load.per_token_s if load is not None else 0.0
            return Coefficients(view.costs.overhead_s, max(view.prefill_token_s, floor), view.costs.per_decode_s)
        if view.knows_prefill or load is None:
            return view.costs
        return Coefficients(view.costs.overhead_s, load.per_token_s, view.costs.per_decode_s)

    def _queued(self, view: DecodeView, load: PrefillLoad) -> int:
        """Prompt tokens P has left to compute now: its last published queue, aged, and the prompts
        D sent it that no load of P's counted yet (a prompt P is part way through counts only what
        is left of it)."""
        age = max(0.0, self._clock() - load.at)
        busy = drain_seconds(load, load.queued_tokens)  # P's steps for its queue, overheads too
        left = math.ceil(load.queued_tokens * (1 - age / busy)) if age < busy else 0
        return left + view.remote_outstanding_tokens

    def _remote_ttft(self, tokens: int, view: DecodeView, load: PrefillLoad | None, costs: Coefficients) -> float:
        return self._compute(tokens, view, load, costs) + self._path_s(view)

    def _compute(self, tokens: int, view: DecodeView, load: PrefillLoad | None, costs: Coefficients) -> float:
        """P's compute of its queue and then this prompt."""
        if load is None:
            load = PrefillLoad("-", 1, 0, costs.per_prefill_token_s, costs.overhead_s, max(tokens, 1), self._clock())
        return drain_seconds(load, self._queued(view, load) + tokens)

    def _path_s(self, view: DecodeView) -> float:
        """The remote TTFT around P's compute: the deployment's `transfer_overhead_ms` where it sets
        one, otherwise what D measured (remote_path.py), DEFAULT_PATH_MS until it has."""
        if self._config.transfer_overhead_ms is not None:
            return self._config.transfer_overhead_ms / 1000
        return view.remote_path_s if view.remote_path_s is not None else DEFAULT_PATH_MS / 1000

    def _local_ttft(self, tokens: int, view: DecodeView, costs: Coefficients, chunk: int) -> float:
        """TTFT of a local prefill behind D's local backlog, which D computes first, `chunk` tokens
        a step (one prompt after another: the scheduler's `_queue_local`)."""
        total = view.local_backlog_tokens + tokens
        step = costs.step_seconds(min(chunk, total), view.running_decodes)
        return math.ceil(total / chunk) * step


def make_policy(config: PlacementConfig) -> PlacementPolicy:
    return AdaptivePolicy(config) if config.adaptive else StaticPolicy()


__all__ = ["AdaptivePolicy", "DecodeView", "PlacementPolicy", "StaticPolicy", "drain_seconds", "make_policy"]
