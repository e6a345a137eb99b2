"""DecodeLoad: D's view of its own load and of its prefill instances', for placement decisions.

Tracks the prompts D decided to prefill itself (their uncomputed tokens are its local backlog),
the prompts it sent to each P whose KV has not landed, the decodes of its last step, its step
costs, and the latest load each P published. Free of vLLM (requests are read through
`num_prompt_tokens` / `num_computed_tokens` only).
"""

from __future__ import annotations

from pdserve.connector.placement import DecodeView
from pdserve.connector.step_costs import StepCosts
from pdserve.control.address import PeerAddress
from pdserve.control.messages import PrefillLoad


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


class DecodeLoad:
    def __init__(self, budget: int):
        self.budget = budget
        self.costs = StepCosts()
        self.running_decodes = 0
        self._local: dict[str, object] = {}  # request id -> request prefilled here
        self._remote: dict[str, tuple[tuple[str, int], int]] = {}  # request id -> (P, prompt tokens)
        self._loads: dict[tuple[str, int], PrefillLoad] = {}

    def add_local(self, request) -> None:
        self._local[request.request_id] = request

    def add_remote(self, request_id: str, peer: PeerAddress, tokens: int) -> None:
        self._remote[request_id] = ((peer.host, peer.handshake_port), tokens)

    def landed(self, request_id: str) -> None:
        self._remote.pop(request_id, None)

    def forget(self, request_id: str) -> None:
        self._local.pop(request_id, None)
        self._remote.pop(request_id, None)

    def on_loads(self, loads: dict[tuple[str, int], PrefillLoad]) -> None:
        self._loads.update(loads)

    def load_of(self, peer: PeerAddress) -> PrefillLoad | None:
        return self._loads.get((peer.host, peer.handshake_port))

    def local_backlog(self) -> int:
        return uncomputed_prompt_tokens(self._local)

    def view(self, peer: PeerAddress) -> DecodeView:
        key = (peer.host, peer.handshake_port)
        outstanding = sum(tokens for p, tokens in self._remote.values() if p == key)
        return DecodeView(self.running_decodes, self.local_backlog(), outstanding, self.budget,
                          self.costs.coefficients(), self.costs.knows_prefill)
