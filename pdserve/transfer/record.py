"""One `Transfer` object per transfer of a request (on this rank), with a status enum; every transition is here.

A transfer moves one request's prompt KV blocks between P and D. Its phases:

    WAITING ─┬─▶ ANNOUNCED   D WRITE: RemoteBlocks sent; waits for P's WriteDone
             ├─▶ COPYING ──▶ CONFIRMING   D READ: copies done; waits for P's ReadAck
             ├─▶ DONE        P READ hold: D's ReadDone matched
             └─▶ STOPPING / FAILED
    ANNOUNCED, COPYING, CONFIRMING ─▶ DONE | STOPPING | FAILED
    STOPPING ─▶ FAILED   once no copy can touch the blocks any more

WAITING: blocked on the peer (D's block ids or a handshake for a P write; a handshake for a D
receive; D's ReadDone or Release for a P hold). STOPPING: winding down (its reason in `error`):
no new copies; it fails once nothing can touch its blocks. DONE and FAILED are terminal: a late
message for a terminal transfer is ignored and never revives it. Every other move raises
`IllegalTransition` naming the expected and the actual state.

A transfer is bound to one peer *incarnation* (`link.identity`) the first time it talks to or
copies with a peer; every later message must come from that incarnation, every copy goes to its
mapping, and a different incarnation at the same address fails the transfer.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING

from pdserve.config import TransferMode
from pdserve.control.address import PeerAddress
from pdserve.errors import PDServeError
from pdserve.transfer.incarnation import Incarnation
from pdserve.transfer.layout import NULL_BLOCK
from pdserve.transfer.ranks import Slicing
from pdserve.transport.base import TransferStatus

if TYPE_CHECKING:
    from pdserve.transfer.kv_digest import BlockDigests

RELEASED_BY_DECODE = "decode released the transfer"  # D gave up on it, or prefills the prompt itself


class Side(Enum):
    SEND = "send"  # P: owns the source blocks
    RECV = "recv"  # D: owns the destination blocks


class TransferState(Enum):
    WAITING = "waiting"
    ANNOUNCED = "announced"
    COPYING = "copying"
    CONFIRMING = "confirming"
    STOPPING = "stopping"
    DONE = "done"
    FAILED = "failed"

    @property
    def is_terminal(self) -> bool:
        return self in (TransferState.DONE, TransferState.FAILED)


_ENDINGS = {TransferState.DONE, TransferState.STOPPING, TransferState.FAILED}
_ALLOWED = {
    TransferState.WAITING: {TransferState.ANNOUNCED, TransferState.COPYING} | _ENDINGS,
    TransferState.ANNOUNCED: _ENDINGS,
    TransferState.COPYING: {TransferState.CONFIRMING} | _ENDINGS,
    TransferState.CONFIRMING: _ENDINGS,
    TransferState.STOPPING: {TransferState.FAILED},
    TransferState.DONE: set(),
    TransferState.FAILED: set(),
}


class IllegalTransition(PDServeError):
    pass


@dataclass
class PeerLink:
    """Which peer incarnation the transfer is bound to, and what waits for that binding."""

    identity: str | None = None  # the peer incarnation this transfer is bound to
    incarnation: Incarnation | None = None  # D: that incarnation, to tell whether it still lives
    refreshed: bool = False  # the peer was handshaken again once for this transfer
    deferred: list = field(default_factory=list)  # (sender, message, received) that arrived before binding


@dataclass
class Copies:
    """The copies this side submitted for the transfer."""

    layers_ready: set[int] = field(default_factory=set)  # P WRITE: layers computed so far
    layers_submitted: set[int] = field(default_factory=set)
    handles: list = field(default_factory=list)
    num_bytes: int = 0
    not_after: float | None = None  # P WRITE, D READ: monotonic time after which no byte of ours may land

    @property
    def pending(self) -> list:
        return [h for h in self.handles if h.status is TransferStatus.PENDING]


@dataclass
class WriteWindow:
    """D WRITE: the write window granted to P by the announcement (see kinds/write_recv.py)."""

    announced_at: float  # monotonic time the announcement was queued
    write_for: float  # seconds P may write our blocks
    fence: float | None = None  # monotonic time after which P provably stopped
    peer_cpu_at_fence: int | None = None  # P on this host: its CPU ticks when the fence passed
    next_release: float = 0.0  # P on this host: when to ask again for its WriteDone


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
    link: PeerLink = field(default_factory=PeerLink)
    copies: Copies = field(default_factory=Copies)
    window: WriteWindow | None = None  # D WRITE, once announced
    slicing: Slicing | None = None  # the heads this rank pair shares, when the ranks hold different ones
    group: str = ""  # the transfer this is a rank pair's sub-transfer of (fanout.py)
    digests: BlockDigests | None = None  # P WRITE with kv_verify: the layers hashed as submitted (kv_digest.py)
    created_at: float = field(default_factory=time.monotonic)
    finished_at: float | None = None

    def _move(self, new: TransferState) -> None:
        if new not in _ALLOWED[self.state]:
            raise IllegalTransition(
                f"transfer {self.transfer_id}: illegal transition {self.state.value} -> {new.value}"
            )
        self.state = new

    def announce(self, window: WriteWindow) -> None:
        self._move(TransferState.ANNOUNCED)
        self.window = window

    def start_copying(self) -> None:
        if self.state is not TransferState.COPYING:
            self._move(TransferState.COPYING)

    def confirm(self) -> None:
        self._move(TransferState.CONFIRMING)

    def stop(self, reason: str) -> bool:
        """Enter STOPPING with `reason`; False (and nothing changes) when already stopping."""
        if self.state is TransferState.STOPPING:
            return False
        self._move(TransferState.STOPPING)
        self.error = reason
        return True

    def succeed(self) -> None:
        self._move(TransferState.DONE)
        self.finished_at = time.monotonic()

    def fail(self, reason: str) -> None:
        self._move(TransferState.FAILED)
        self.error = reason
        self.finished_at = time.monotonic()

    @property
    def stopping(self) -> bool:
        return self.state is TransferState.STOPPING

    @property
    def seconds(self) -> float:
        end = self.finished_at if self.finished_at is not None else time.monotonic()
        return end - self.created_at

    def describe(self) -> str:
        """One line of state for logs: what a stuck or failed transfer was waiting for."""
        handles = ",".join(h.status.value for h in self.copies.handles) or "none"
        return (f"{self.side.value} {self.mode.value} state={self.state.value} age={self.seconds:.2f}s "
                f"peer={self.link.identity or '-'} error={self.error or '-'} "
                f"remote_blocks={'yes' if self.remote_block_ids is not None else 'no'} "
                f"layers ready={len(self.copies.layers_ready)} submitted={len(self.copies.layers_submitted)} "
                f"copies={handles}")

    def group_pairs(self, sparse: Sequence[bool] = (False,)) -> list[list[tuple[int, int]]]:
        """Per KV cache group, the (local, remote) block pairs to move from `first_block` on. The
        block lists hold one run of equal length per group, in group order. In a sparse group
        (kv_groups.py: a sliding window's blocks that left it, a state group's all but the last)
        a block D does not need is skipped; one D needs that P does not hold is an error."""
        local, remote = self.local_block_ids, self.remote_block_ids or ()
        if len(remote) != len(local) or len(remote) % len(sparse):
            raise PDServeError(f"block counts differ: {len(local)} here, {len(remote)} on the peer "
                               f"({len(sparse)} KV cache groups)")
        n = len(remote) // len(sparse)
        out = []
        for g, skips in enumerate(sparse):
            pairs = []
            for i in range(g * n + self.first_block, (g + 1) * n):
                decode, prefill = (local[i], remote[i]) if self.side is Side.RECV else (remote[i], local[i])
                if skips and decode == NULL_BLOCK:
                    continue
                if skips and prefill == NULL_BLOCK:
                    raise PDServeError(f"decode needs block {i - g * n} of KV cache group {g}, which prefill does "
                                       "not hold")
                pairs.append((local[i], remote[i]))
            out.append(pairs)
        return out
