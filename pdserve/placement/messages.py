"""Placement's two wire messages: P's load (`PrefillLoad`) and D's status (`DecodeStatus`).

Registered with the control plane's codec by `@message`, like the transfer messages of
pdserve/control/messages.py; importing this module is what makes the codec accept them.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from pdserve.control.messages import check, message

MAX_PREFILL_PEERS = 256  # prefill instances a DecodeStatus reports on
MAX_COUNTED_TRANSFERS = 64  # legs a PrefillLoad names: far above a queue D would still send to


@message("prefill_load")
@dataclass(frozen=True)
class PrefillLoad:
    """P -> D (adaptive placement): prompt tokens P has accepted and not yet computed, and what
    its steps cost (learnt from the steps it ran), measured at unix time `at`. D estimates how
    long a prompt it sends now waits at P. `prefill_host`:`prefill_handshake_port` names the
    P (as the router's kv_transfer_params do). `counted_transfers`: the transfer ids of the legs
    `queued_tokens` counts (at most MAX_COUNTED_TRANSFERS; a longer queue lists its oldest), so
    D adds to it only the prompts it sent that P had not taken in yet."""

    prefill_host: str
    prefill_handshake_port: int
    queued_tokens: int
    per_token_s: float
    overhead_s: float
    budget: int
    at: float
    prefill_share: float = 0.0  # of the last seconds, P's share in steps with prompt tokens (prefill_share.py)
    decodes: int = 0  # streams P decodes itself (requests it serves whole), as of its latest step
    counted_transfers: list[str] = dataclasses.field(default_factory=list)

    def validate(self) -> None:
        check(0 < len(self.prefill_host) <= 255, type(self), "prefill_host must be a host name")
        check(len(self.counted_transfers) <= MAX_COUNTED_TRANSFERS, type(self),
               f"{len(self.counted_transfers)} counted transfers (max {MAX_COUNTED_TRANSFERS})")
        check(all(0 < len(t) <= 256 for t in self.counted_transfers), type(self),
               "counted_transfers must be transfer ids of 1..256 characters")
        check(0 < self.prefill_handshake_port < 65536, type(self), "prefill_handshake_port is not a port")
        check(0 <= self.queued_tokens < 1 << 40, type(self), f"queued_tokens {self.queued_tokens} out of range")
        check(0 < self.budget < 1 << 30, type(self), f"budget {self.budget} out of range")
        for name in ("per_token_s", "overhead_s"):
            value = getattr(self, name)
            check(math.isfinite(value) and 0 <= value < 60, type(self), f"{name} {value} is not a cost in seconds")
        check(math.isfinite(self.at), type(self), "at must be a finite unix time")
        check(math.isfinite(self.prefill_share) and 0 <= self.prefill_share <= 1, type(self),
               f"prefill_share {self.prefill_share} is not a share in [0, 1]")
        check(0 <= self.decodes < 1 << 40, type(self), f"decodes {self.decodes} out of range")


@message("decode_status")
@dataclass(frozen=True)
class DecodeStatus:
    """D -> P (adaptive placement): in READ mode, where P decides, D's side of a placement decision;
    in WRITE mode, how loaded D's streams are, for a P that serves whole requests while they are
    (serve_gate.py). Measured at unix time `at` (status_view.py). `decode_host`:`decode_handshake_port`
    names the D (as the router's request id does). Costs are None until D has measured them."""

    decode_host: str
    decode_handshake_port: int
    running_decodes: int
    local_backlog_tokens: int
    budget: int
    chunk: int
    knows_prefill: bool
    stream_tokens: float
    at: float
    placed_local: dict[str, int] = dataclasses.field(default_factory=dict)  # "P host:port" -> its local legs D placed
    overhead_s: float | None = None
    per_token_s: float | None = None
    per_decode_s: float | None = None
    recent_itl_s: float | None = None
    prefill_token_s: float | None = None
    now_itl_s: float | None = None
    chunk_headroom: float | None = None  # of its bound D plans a local chunk step to fill (chunk_headroom.py)

    def validate(self) -> None:
        check(0 < len(self.decode_host) <= 255, type(self), "decode_host must be a host name")
        check(0 < self.decode_handshake_port < 65536, type(self), "decode_handshake_port is not a port")
        for name in ("running_decodes", "local_backlog_tokens", "chunk"):
            value = getattr(self, name)
            check(0 <= value < 1 << 40, type(self), f"{name} {value} out of range")
        check(0 < self.budget < 1 << 30, type(self), f"budget {self.budget} out of range")
        check(math.isfinite(self.stream_tokens) and 0 <= self.stream_tokens < 1 << 30, type(self),
               f"stream_tokens {self.stream_tokens} out of range")
        check(math.isfinite(self.at), type(self), "at must be a finite unix time")
        check(len(self.placed_local) <= MAX_PREFILL_PEERS, type(self),
               f"placed_local names {len(self.placed_local)} prefill instances (max {MAX_PREFILL_PEERS})")
        check(all(0 < len(k) <= 300 and 0 <= v < 1 << 62 for k, v in self.placed_local.items()), type(self),
               "placed_local maps 'host:port' to a count")
        costs = (self.overhead_s, self.per_token_s, self.per_decode_s)
        check(all(c is None for c in costs) or all(c is not None for c in costs), type(self),
               "overhead_s, per_token_s and per_decode_s are given together or not at all")
        for name in ("overhead_s", "per_token_s", "per_decode_s", "recent_itl_s", "prefill_token_s", "now_itl_s"):
            value = getattr(self, name)
            check(value is None or math.isfinite(value) and -60 < value < 60, type(self),
                   f"{name} {value} is not a cost in seconds")
        check(self.chunk_headroom is None or math.isfinite(self.chunk_headroom) and 0 < self.chunk_headroom <= 1,
               type(self), f"chunk_headroom {self.chunk_headroom} is not a share in (0, 1]")
