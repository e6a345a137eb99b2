"""PrefillGate: on P, under adaptive placement, a prefill leg runs only once D said so.

vllm-router (WRITE mode) sends each request's prefill leg to P and its decode leg to D at once.
D decides where the prompt is prefilled (policy.py) and says so over the control
plane: its RemoteBlocks mean "prefill here and push the KV", its Release "I prefill it myself".
Until then the leg waits in P's queue (vLLM's "ask again next step"), costing nothing; after
`wait_s` without word it is prefilled anyway, as under static placement, which is always safe
(D recomputes or takes the KV). A dropped leg never runs its prompt. Free of vLLM.
"""

from __future__ import annotations

import enum
import time


class Verdict(enum.Enum):
    ASK = "ask"  # first time seen: ask the worker to watch for D's decision; wait
    WAIT = "wait"
    PREFILL = "prefill"
    DROP = "drop"


class PrefillGate:
    def __init__(self, wait_s: float, clock=time.monotonic):
        self._wait_s = wait_s
        self._clock = clock
        self._since: dict[str, float] = {}
        self._decided: dict[str, bool] = {}
        self.num_timed_out = 0

    def verdict(self, request_id: str) -> Verdict:
        decided = self._decided.get(request_id)
        if decided is not None:
            return Verdict.PREFILL if decided else Verdict.DROP
        now = self._clock()
        since = self._since.get(request_id)
        if since is None:
            self._since[request_id] = now
            return Verdict.ASK
        if now - since >= self._wait_s:
            self._decided[request_id] = True
            self.num_timed_out += 1
            return Verdict.PREFILL
        return Verdict.WAIT

    def on_decisions(self, decided: dict[str, bool]) -> None:
        """D's decisions as the worker saw them; the first word for a request is final."""
        for request_id, prefill_here in decided.items():
            if request_id in self._since and request_id not in self._decided:
                self._decided[request_id] = prefill_here

    def dropped(self, request_id: str) -> bool:
        return self._decided.get(request_id) is False

    def forget(self, request_id: str) -> None:
        self._since.pop(request_id, None)
        self._decided.pop(request_id, None)

    def __len__(self) -> int:
        return len(self._since)
