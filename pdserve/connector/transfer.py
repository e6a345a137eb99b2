"""One `Transfer` object per request leg, with a status enum; every transition is here.

A transfer moves one request's prompt KV blocks between P and D. Its life:

    WAITING ──▶ COPYING ──▶ DONE
       │           │
       └───────────┴──────▶ FAILED

WAITING: blocked on the peer (D's block ids or a handshake for a P write; P's `write_done` for a
D receive; D's `release` for a P hold). COPYING: blocks are moving. DONE and FAILED are
terminal: a late message for a terminal transfer is ignored and never revives it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum

from pdserve.config import TransferMode
from pdserve.control.address import PeerAddress
from pdserve.errors import PDServeError


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
    state: TransferState = TransferState.WAITING
    error: str = ""
    layers_ready: set[int] = field(default_factory=set)  # P WRITE: layers computed this step
    layers_submitted: set[int] = field(default_factory=set)
    handles: list = field(default_factory=list)
    num_bytes: int = 0
    release_requested: bool = False  # WRITE: D gave up; P stops writing, then confirms
    hold_expires_at: float | None = None  # D READ: unix time after which P may free its blocks
    confirming: bool = False  # D READ: copies done, waiting for P to confirm it held those blocks
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
                f"remote_blocks={'yes' if self.remote_block_ids is not None else 'no'} "
                f"layers ready={len(self.layers_ready)} submitted={len(self.layers_submitted)} copies={handles}")

    def block_pairs(self) -> list[tuple[int, int]]:
        """(local, remote) block pairs to move, from `first_block` on."""
        remote = self.remote_block_ids or ()
        count = min(len(self.local_block_ids), len(remote))
        return [(self.local_block_ids[i], remote[i]) for i in range(self.first_block, count)]
