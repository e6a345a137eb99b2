"""The connector's scheduler side: what runs in vLLM's scheduler (EngineCore) process.

It sees vLLM's `Request` objects and block ids and tells the worker side what to do through a
`StepPlan` (connector/metadata.py) once per step. Free of vLLM's imports. The modules:

- base.py: `PDScheduler`, the hooks both roles share; prefill.py and decode.py: a role each
- legs/: a request's leg on this instance (`Leg`, `LegStatus`, in legs/base.py) and the leg kinds
  that move its KV: legs/prefill_send.py (P, WRITE), legs/prefill_hold.py (P, READ),
  legs/decode_receive.py (D)
- prefill_placement.py: P's side of placement; step_pacing.py: the step clock and prefill limit
- siblings.py: the children of an n > 1 request; whole_requests.py: P serving requests whole
- leg_truncation.py: a prefill leg cut short; prompt_digest.py: the prompt digest legs carry
"""

from __future__ import annotations

from typing import Callable

from pdserve.config import ConnectorConfig, Role
from pdserve.connector.kv_groups import ONE_GROUP, KvGroups
from pdserve.connector.scheduler.base import PDScheduler
from pdserve.connector.scheduler.decode import DecodeScheduler
from pdserve.connector.scheduler.prefill import PrefillScheduler


def scheduler_for(config: ConnectorConfig, block_size: int, budget: int = 2048, chunk: int | None = None,
                   set_chunk: Callable[[int], None] | None = None, groups: KvGroups = ONE_GROUP) -> PDScheduler:
    """The scheduler side of this instance's role. `budget`: its --max-num-batched-tokens; `chunk`:
    vLLM's per-prompt prefill limit at start; `set_chunk` sets it for the next step (adaptive)."""
    side = PrefillScheduler if config.role is Role.PRODUCER else DecodeScheduler
    return side(config, block_size, budget, chunk, set_chunk, groups)


__all__ = ["DecodeScheduler", "PDScheduler", "PrefillScheduler", "scheduler_for"]
