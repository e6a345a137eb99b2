"""What the scheduler half tells the worker half each step: a `StepPlan` (pickled by vLLM's
executor inside the facade's `PDConnectorMetadata`). Free of vLLM, so the state machines can be
tested without it."""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.config import TransferMode
from pdserve.control.address import PeerAddress
from pdserve.placement import Decision, DecodeStatus, PrefillLoad


@dataclass(frozen=True)
class SendSpec:
    """P, WRITE: this step computes the request's last prompt chunk; push each layer's blocks."""

    request_id: str
    transfer_id: str
    peer: PeerAddress
    block_ids: tuple[int, ...]
    prompt_hash: str


@dataclass(frozen=True)
class HoldSpec:
    """P, READ: the request finished; its blocks stay until D releases them or `expires_at`."""

    request_id: str
    transfer_id: str
    block_ids: tuple[int, ...]
    expires_at: float  # unix time
    prompt_hash: str


@dataclass(frozen=True)
class StageSpec:
    """P, READ, KV on a GPU staged in host memory: this step computes the request's last prompt
    chunk; its blocks reach the host mirror before the step ends (D may read them as soon as the
    request's answer leaves P)."""

    request_id: str
    transfer_id: str
    block_ids: tuple[int, ...]


@dataclass(frozen=True)
class RecvSpec:
    """D: blocks were allocated for a remote prefill; get the KV into block_ids[first_block:]."""

    request_id: str
    transfer_id: str
    mode: TransferMode
    peer: PeerAddress | None
    block_ids: tuple[int, ...]
    first_block: int
    remote_block_ids: tuple[int, ...] | None  # READ only
    hold_expires_at: float | None  # READ only
    prompt_hash: str = ""
    error: str = ""  # the request's kv_transfer_params were malformed: fail it with this message


@dataclass(frozen=True)
class CancelSpec:
    """Either side: this transfer will not happen, or must stop now (a preempted prefill's blocks
    are already freed); tell the peer so it frees what it holds."""

    transfer_id: str
    peer: PeerAddress
    reason: str


@dataclass(frozen=True)
class AwaitSpec:
    """P, adaptive placement: this prefill leg waits for its decode instance's decision (D's
    RemoteBlocks: prefill here; D's Release: D prefills the prompt itself)."""

    request_id: str
    transfer_id: str
    peer: PeerAddress


@dataclass
class StepPlan:
    sends: list[SendSpec] = field(default_factory=list)
    holds: list[HoldSpec] = field(default_factory=list)
    stages: list[StageSpec] = field(default_factory=list)
    recvs: list[RecvSpec] = field(default_factory=list)
    cancels: list[CancelSpec] = field(default_factory=list)
    awaits: list[AwaitSpec] = field(default_factory=list)
    load: PrefillLoad | None = None  # P, adaptive: what to publish to decode instances
    status: DecodeStatus | None = None  # D, adaptive, READ: what to publish to prefill instances
    placements: list[Decision] = field(default_factory=list)  # placement decisions that took effect this step
    served_whole: int = 0  # P, serve_decode: requests it serves whole whose prefill leg it dropped this step
    # its last step with a chunk beside streams (D; P with serve_decode): whether it ran past its bound
    chunk_steps_over: list[bool] = field(default_factory=list)
    # D: seconds of path of remote prompts that took their first token (placement/remote_path.py)
    remote_paths: list[float] = field(default_factory=list)
    idle: bool = False  # no tokens scheduled this step: the worker may wait briefly for progress
