"""Eager prefill: an idle P starts a prefill leg before D's decision, and says so.

Under adaptive placement P holds each leg until D's word (prefill_gate.py). That word comes only
once D's scheduler next runs, which on a busy D is up to one decode step after the leg arrived,
plus a control-plane hop, and every remote prefill's TTFT pays that wait. When P has no prompt of
its own to compute (nothing accepted or served whole is left uncomputed), holding the leg saves
nothing: P's next step would be empty. So P starts it at once and tells D (`PrefillStarted`).

D takes that word as its decision (remote, `prefill_started`) when it arrives before D decided.
When D decided first and prefills the prompt itself, its Release stops P's send exactly as a late
Release does under static placement, and what P computed, on a step it had nothing else for, is
lost. Served tokens never depend on the order: D's blocks either receive P's KV (after D's
RemoteBlocks) or P never writes them (after D's Release). Free of vLLM.
"""

from __future__ import annotations

import time
from collections import OrderedDict

from pdserve.connector.decode_load import uncomputed_prompt_tokens

EAGER_LABEL = "remote:eager"  # P's placement label for a leg it started before D's word
MAX_STARTED = 4096


def prefill_idle(accepted: dict, whole: dict) -> bool:
    """P: no prompt it took on (legs D sent it, requests it serves whole) is left to compute."""
    return uncomputed_prompt_tokens(accepted) == 0 and uncomputed_prompt_tokens(whole) == 0


class StartedLegs:
    """D: the transfers its prefill instances said they started, until the decode leg is placed,
    ends, or `expiry_s` passes (its decode leg may never come: an aborted request)."""

    def __init__(self, expiry_s: float, clock=time.monotonic):
        self._expiry_s = expiry_s
        self._clock = clock
        self._started: OrderedDict[str, float] = OrderedDict()  # transfer id -> expiry

    def add(self, transfer_ids) -> None:
        now = self._clock()
        while self._started and next(iter(self._started.values())) < now:
            self._started.popitem(last=False)
        for tid in transfer_ids:
            self._started[tid] = now + self._expiry_s
            self._started.move_to_end(tid)
        while len(self._started) > MAX_STARTED:
            self._started.popitem(last=False)

    def __contains__(self, transfer_id: str) -> bool:
        expiry = self._started.get(transfer_id)
        return expiry is not None and expiry >= self._clock()

    def forget(self, transfer_id: str) -> None:
        self._started.pop(transfer_id, None)

    def __len__(self) -> int:
        return len(self._started)
