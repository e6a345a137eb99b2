"""One `Transfer` object per request leg, with a status enum; every transition is here.

A transfer moves one request's prompt KV blocks between P and D. Its life:

    WAITING ──▶ COPYING ──▶ DONE
       │           │
       └───────────┴──────▶ FAILED

WAITING: blocked on the peer (D's block ids or a handshake for a P write; P's `write_done` for a
D receive; D's `release` for a P hold). COPYING: blocks are moving. DONE and FAILED are
terminal: a late message for a terminal transfer is ignored and never revives it.

A transfer is bound to one peer *incarnation* (`peer_identity`) the first time it talks to or
copies with a peer; every later message must come from that incarnation, every copy goes to its
mapping, and a different incarnation at the same address fails the transfer. A D-side transfer
reaches FAILED only when no copy can still touch its blocks (P confirmed it stopped, P is
provably dead, or the write window D granted has provably closed: see engine.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum

from pdserve.config import TransferMode
from pdserve.connector.incarnation import Incarnation
from pdserve.control.address import PeerAddress
from pdserve.errors import PDServeError
from pdserve.transport.base import TransferStatus


class Side(Enum):
    SEND = "send"  # P: owns the source blocks
    RECV = "recv"  # D: owns the destination blocks


class TransferState(Enum):
    WAITING = "waiting"
    COPYING = "copying"
    DONE = "done"
    FAILED = "failed"

    @property
    def is_terminal(self) -> bool:
        return self in (TransferState.DONE, TransferState.FAILED)


_ALLOWED = {
    TransferState.WAITING: {TransferState.COPYING, TransferState.DONE, TransferState.FAILED},
    TransferState.COPYING: {TransferState.DONE, TransferState.FAILED},
    TransferState.DONE: set(),
    TransferState.FAILED: set(),
}


class IllegalTransition(PDServeError):
    pass


@dataclass(eq=False)
class Transfer:
    transfer_id: str
    request_id: str
    side: Side
    mode: TransferMode
    peer: PeerAddress | None  # None for a P hold: D comes to us
    local_block_ids: tuple[int, ...]
    deadline: float  # time.monotonic() after which the transfer fails
    remote_block_ids: tuple[int, ...] | None = None
    first_block: int = 0  # blocks before this index are not moved (D's local prefix hit)
    prompt_hash: str = ""  # digest of the prompt's token ids (prompt_digest.py)
    state: TransferState = TransferState.WAITING
    error: str = ""
    peer_identity: str | None = None  # the peer incarnation this transfer is bound to
    peer_incarnation: Incarnation | None = None  # D: that incarnation, to tell whether it still lives
    refreshed: bool = False  # the peer was handshaken again once for this transfer
    layers_ready: set[int] = field(default_factory=set)  # P WRITE: layers computed this step
    layers_submitted: set[int] = field(default_factory=set)
    handles: list = field(default_factory=list)
    num_bytes: int = 0
    announced: bool = False  # D WRITE: RemoteBlocks sent, so P may write our blocks for write_for s
    announced_at: float = 0.0  # D WRITE: monotonic time the announcement was queued
    write_for: float = 0.0  # D WRITE: the write window granted to P (seconds)
    not_after: float | None = None  # P WRITE: monotonic time after which no byte of ours may land
    peer_cpu_at_fence: int | None = None  # D WRITE, P on this host: P's CPU ticks when the fence passed
    next_release: float = 0.0  # D WRITE, P on this host: when to ask again for P's WriteDone
    stopping: str = ""  # why it is winding down: P stops copying / D waits for P to confirm
    fence_deadline: float | None = None  # D WRITE: monotonic time after which P provably stopped
    hold_expires_at: float | None = None  # D READ: unix time after which P may free its blocks
    confirming: bool = False  # D READ: copies done, waiting for P to confirm it held those blocks
    deferred: list = field(default_factory=list)  # (sender, message) that arrived before binding
    created_at: float = field(default_factory=time.monotonic)
    finished_at: float | None = None

    def _move(self, new: TransferState) -> None:
        if new not in _ALLOWED[self.state]:
            raise IllegalTransition(
                f"transfer {self.transfer_id}: illegal transition {self.state.value} -> {new.value}"
            )
        self.state = new

    def start_copying(self) -> None:
        if self.state is not TransferState.COPYING:
            self._move(TransferState.COPYING)

    def succeed(self) -> None:
        self._move(TransferState.DONE)
        self.finished_at = time.monotonic()

    def fail(self, reason: str) -> None:
        self._move(TransferState.FAILED)
        self.error = reason
        self.finished_at = time.monotonic()

    @property
    def seconds(self) -> float:
        end = self.finished_at if self.finished_at is not None else time.monotonic()
        return end - self.created_at

    def describe(self) -> str:
        """One line of state for logs: what a stuck or failed transfer was waiting for."""
        handles = ",".join(h.status.value for h in self.handles) or "none"
        return (f"{self.side.value} {self.mode.value} state={self.state.value} age={self.seconds:.2f}s "
                f"peer={self.peer_identity or '-'} stopping={self.stopping or '-'} "
                f"remote_blocks={'yes' if self.remote_block_ids is not None else 'no'} "
                f"layers ready={len(self.layers_ready)} submitted={len(self.layers_submitted)} copies={handles}")

    def block_pairs(self) -> list[tuple[int, int]]:
        """(local, remote) block pairs to move, from `first_block` on. Both sides must name the
        same number of blocks: a mismatch means the two legs are not the same prompt."""
        remote = self.remote_block_ids or ()
        if len(remote) != len(self.local_block_ids):
            raise PDServeError(f"block counts differ: {len(self.local_block_ids)} here, {len(remote)} on the peer")
        return [(self.local_block_ids[i], remote[i]) for i in range(self.first_block, len(remote))]

    @property
    def pending_handles(self) -> list:
        return [h for h in self.handles if h.status is TransferStatus.PENDING]
