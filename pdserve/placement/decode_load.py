"""DecodeLoad: D's view of its own load and of its prefill instances', for placement decisions.

Tracks the prompts D decided to prefill itself (their uncomputed tokens are its local backlog),
the prompts it sent to each P whose KV has not landed (and whether a load P published counted them
yet: once it has, P's aged queue covers them), the decodes of its last step, its step costs, how
long the path of its remote prompts around P's compute measured (remote_path.py), the mean ITL its
streams saw over the last stream lifetime (the mean output length of its finished requests x the
ITL target: the decode-weighted mean of its step times) and over the last NOW_SPAN_S (how loaded
its streams are now, for serve_gate.py), and the latest load each P published. Free of vLLM
(requests are read through `request_id`, `num_prompt_tokens` and `num_computed_tokens` only).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from pdserve.control.address import PeerAddress
from pdserve.placement.chunk_costs import ChunkCosts
from pdserve.placement.messages import PrefillLoad
from pdserve.placement.policy import DecodeView
from pdserve.placement.remote_path import RemotePath
from pdserve.placement.step_costs import StepCosts


@dataclass
class _Remote:
    """A prompt D sent to a prefill instance, until its KV lands."""

    peer: tuple[str, int]
    tokens: int
    transfer_id: str
    counted: bool = False  # a load of that P named it: P's published queue counts it from then on


def uncomputed_prompt_tokens(requests: dict) -> int:
    """Prompt tokens the tracked requests have not computed yet; those with none left are dropped."""
    total = 0
    for rid, request in list(requests.items()):
        left = request.num_prompt_tokens - request.num_computed_tokens
        if left <= 0:
            del requests[rid]
        else:
            total += left
    return total


STREAM_WEIGHT = 0.05  # of each finished request in the mean output length
MAX_SPAN_S = 120.0  # steps longer ago than this are forgotten
NOW_SPAN_S = 2.0  # the span of `now_itl`: a few of D's status periods, short beside a stream's life


class DecodeLoad:
    def __init__(self, budget: int, itl_target_s: float = 0.05, clock=time.monotonic, chunk: int | None = None):
        self.budget = budget
        self.chunk = chunk or budget
        self.costs = StepCosts()
        self.chunk_costs = ChunkCosts()  # a prompt token's cost in D's chunk steps, and their headroom
        self.remote_path = RemotePath(clock=clock)  # a remote TTFT beyond P's compute, measured
        self.running_decodes = 0
        self._itl_target_s = itl_target_s
        self._clock = clock
        self._steps: deque[tuple[float, float, int]] = deque()  # (when, seconds, decodes) of D's decode steps
        self._stream_tokens = 0.0
        self._local: dict[str, object] = {}  # request id -> request prefilled here
        self._remote: dict[str, _Remote] = {}  # request id -> a prompt sent to a P, until its KV lands
        self._loads: dict[tuple[str, int], PrefillLoad] = {}

    def add_local(self, request) -> None:
        self._local[request.request_id] = request

    def add_remote(self, request_id: str, peer: PeerAddress, tokens: int, transfer_id: str = "",
                   compute_s: float | None = None) -> None:
        """`compute_s`: P's compute for it (its queue first) as the decision estimated it (None: no estimate)."""
        self._remote[request_id] = _Remote((peer.host, peer.handshake_port), tokens, transfer_id)
        if compute_s is not None:
            self.remote_path.placed(request_id, compute_s)

    def landed(self, request_id: str) -> None:
        self._remote.pop(request_id, None)
        self.remote_path.landed(request_id)

    def forget(self, request_id: str) -> None:
        self._local.pop(request_id, None)
        self._remote.pop(request_id, None)
        self.remote_path.forget(request_id)

    def streams_after(self, scheduled: dict[str, int]) -> int:
        """How many of the requests this step computes decode in the next one: all but the local
        prompts still prefilling (a request whose KV landed computes its last prompt tokens first)."""
        uncomputed_prompt_tokens(self._local)
        return sum(1 for rid in scheduled if rid not in self._local)

    def on_step(self, seconds: float, decodes: int, prefill_tokens: int = 0) -> None:
        """A finished step that took `seconds`, gave `decodes` streams a token each and computed
        `prefill_tokens` prompt tokens. A step with a chunk of local prefill also teaches what a
        prompt token costs in such a step and how full of its bound the next is planned
        (chunk_costs.py)."""
        self.chunk_costs.on_step(seconds, self.costs, decodes, prefill_tokens)
        if decodes > 0 and seconds >= 0:
            now = self._clock()
            self._steps.append((now, seconds, decodes))
            while now - self._steps[0][0] > MAX_SPAN_S:  # bounded whether or not anyone asks
                self._steps.popleft()

    def on_finished(self, output_tokens: int) -> None:
        """A request that ended after `output_tokens` tokens (its stream's length)."""
        if output_tokens <= 0:
            return
        if self._stream_tokens == 0:
            self._stream_tokens = float(output_tokens)
        else:
            self._stream_tokens += STREAM_WEIGHT * (output_tokens - self._stream_tokens)

    def recent_itl(self) -> float | None:
        """The mean time between two tokens of D's streams over the last stream lifetime (None: no
        stream finished yet, or no token in that span)."""
        return self._mean_itl(self._stream_tokens * self._itl_target_s)

    def now_itl(self) -> float | None:
        """The mean time between two tokens of D's streams over the last NOW_SPAN_S (None: no token
        in that span): follows D's load within seconds, where the lifetime mean lags it by a life."""
        return self._mean_itl(NOW_SPAN_S)

    def _mean_itl(self, span: float) -> float | None:
        now = self._clock()
        tokens, weighted = 0, 0.0
        for when, seconds, decodes in reversed(self._steps):  # newest first: stop at the span's start
            if now - when >= span:
                break
            tokens += decodes
            weighted += seconds * decodes
        return weighted / tokens if tokens else None

    def on_loads(self, loads: dict[tuple[str, int], PrefillLoad]) -> None:
        self._loads.update(loads)
        for key, load in loads.items():
            counted = set(load.counted_transfers)
            for remote in self._remote.values():
                if remote.peer == key and remote.transfer_id in counted:
                    remote.counted = True

    def load_of(self, peer: PeerAddress) -> PrefillLoad | None:
        return self._loads.get((peer.host, peer.handshake_port))

    def local_backlog(self) -> int:
        return uncomputed_prompt_tokens(self._local)

    def local_prompts(self) -> int:
        """Prompts D is prefilling itself and has not finished computing."""
        uncomputed_prompt_tokens(self._local)
        return len(self._local)

    def local_turn(self, request_id: str) -> bool:
        """Whether `request_id` is the oldest prompt D decided to prefill itself that is not
        computed yet. D prefills its own prompts one after another, in the order it took them: two
        sharing each chunk would both finish late, and the first was placed here for the TTFT it
        gets alone."""
        uncomputed_prompt_tokens(self._local)
        return next(iter(self._local), None) == request_id

    def some_load(self) -> PrefillLoad | None:
        """The latest load of one of the prefill instances (for P's per-token cost before D has its own)."""
        return max(self._loads.values(), key=lambda load: load.at, default=None)

    def view(self, peer: PeerAddress | None) -> DecodeView:
        """D's side of a decision for a prompt `peer` would prefill (None: no particular P)."""
        key = (peer.host, peer.handshake_port) if peer is not None else None
        outstanding = sum(r.tokens for r in self._remote.values() if r.peer == key and not r.counted)
        return DecodeView(self.running_decodes, self.local_backlog(), outstanding, self.budget,
                          self.costs.coefficients(), self.costs.knows_prefill, self.recent_itl(),
                          self._stream_tokens, self.chunk, self.chunk_costs.prefill_token_s, self.now_itl(),
                          self.chunk_costs.headroom.headroom(), self.remote_path.seconds())
