"""What the worker half hands the transfer engine from each step's plan: one spec per transfer to
send, hold, receive, cancel or keep waiting for placement's word. Free of vLLM."""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.config import TransferMode
from pdserve.control.address import PeerAddress


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
    """P, adaptive placement: this prefill transfer waits for its decode instance's decision (D's
    RemoteBlocks: prefill here; D's Release: D prefills the prompt itself)."""

    request_id: str
    transfer_id: str
    peer: PeerAddress
