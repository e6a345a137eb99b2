"""A placement decision: where one request's prompt is prefilled, and why.

`remote`: P prefills it and its KV moves to D; `local`: D prefills it itself and P's leg is
dropped without running the prompt. A decision's label ("local:local_faster") names it in
metrics, logs and, in READ mode, the `placement` key of P's kv_transfer_params (params.py).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Placement(enum.Enum):
    REMOTE = "remote"  # P prefills, KV moves to D
    LOCAL = "local"  # D prefills in chunks; P's leg is dropped without running the prompt


class Reason(enum.Enum):
    STATIC = "static"  # the static policy
    WARMING_UP = "warming_up"  # no cost estimates yet: disaggregate
    REMOTE_FASTER = "remote_faster"
    LOCAL_FASTER = "local_faster"
    WITHIN_TTFT = "within_ttft"  # P meets the declared TTFT target: D's streams keep their ITL budget
    ITL_GUARD = "itl_guard"  # local would be faster, but D's streams would exceed the mean ITL target
    TTFT_RESCUE = "ttft_rescue"  # P would miss the declared TTFT bound, D meets it: the ITL guard's headroom is spent
    STEP_GUARD = "step_guard"  # D's streams leave no chunk of prefill room within max_step_ms
    LONG_PROMPT = "long_prompt"  # more uncached tokens than max_local_tokens: always disaggregated
    PREFILL_IDLE = "prefill_idle"  # P has nothing queued: it prefills at once, and D stays free to decide and decode
    NO_WORD = "no_word"  # P, WRITE: no decision from D within placement_wait; P prefilled the leg
    BALANCE = "balance"  # P decodes streams too: the side whose streams advance faster with the prompt (balance.py)


@dataclass(frozen=True)
class Decision:
    placement: Placement
    reason: Reason
    ttft_local_s: float | None = None
    ttft_remote_s: float | None = None
    compute_s: float | None = None  # of ttft_remote_s, P's compute of its queue and the prompt (remote_path.py)

    @property
    def label(self) -> str:
        return f"{self.placement.value}:{self.reason.value}"

    @classmethod
    def from_label(cls, label: str) -> "Decision":
        """The decision a label names ("local:local_faster"); ValueError for anything else."""
        placement, _, reason = label.partition(":")
        return cls(Placement(placement), Reason(reason))


__all__ = ["Decision", "Placement", "Reason"]
