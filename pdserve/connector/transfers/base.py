"""`LegKind`: what one kind of transfer leg does at each event the engine hands it.

The engine calls these hooks on the worker thread, with the transfer not terminal; a hook drives
the transfer through its transitions (transfer.py) and the engine's shared operations
(`Engine` below: `stop`, `finish`, `submit`; `messenger` to talk to the peer, `binding` to reach
the peer incarnation the transfer is bound to). The defaults do nothing.
"""

from __future__ import annotations

import logging
from typing import Protocol

from pdserve.config import ConnectorConfig
from pdserve.connector.peers import Peer
from pdserve.connector.transfer import Transfer
from pdserve.connector.transfers.completions import TransferStats
from pdserve.connector.transfers.messenger import Messenger
from pdserve.transport.base import Direction

logger = logging.getLogger("pdserve.connector")


class Engine(Protocol):
    """What the leg kinds and the peer binding use of `TransferEngine` (engine.py)."""

    config: ConnectorConfig
    messenger: Messenger
    binding: object  # binding.PeerBinding, which needs this module
    stats: TransferStats
    num_layers: int
    staging: object  # the StagedTransport with host staging, else None
    staged: dict[str, None]  # host staging, P READ: holds whose KV reached the host mirror

    def land(self, t: Transfer) -> None: ...

    def bytes_to_move(self, t: Transfer) -> int: ...

    def kind(self, t: Transfer) -> LegKind: ...

    def running(self) -> list[Transfer]: ...

    def deliver(self, t: Transfer, sender: str, message, received: float) -> None: ...

    def submit(self, t: Transfer, peer: Peer, direction: Direction, layers) -> None: ...

    def stop(self, t: Transfer, reason: str, tell_peer: bool) -> None: ...

    def finish(self, t: Transfer) -> None: ...


class LegKind:
    def __init__(self, engine: Engine):
        self.engine = engine

    def on_message(self, t: Transfer, sender: str, message, received: float) -> None:
        """A message from the incarnation `t` is bound to (or from its peer, before binding on P)."""

    def on_peer(self, t: Transfer, peer: Peer) -> None:
        """A handshake with `t`'s peer ended (`peer` READY, or FAILED and maybe refused)."""
        if peer.refused_by:
            self.engine.stop(t, peer.error, tell_peer=True)  # incompatible: it will never take part

    def on_bound(self, t: Transfer, peer: Peer) -> None:
        """D: `t` was just bound to `peer`'s incarnation and is not stopping."""

    def on_rebind(self, t: Transfer) -> None:
        """D: `t` was bound already and its peer may have become ready again."""

    def copies_settled(self, t: Transfer) -> None:
        """No copy of `t` is pending, none failed, and `t` is not stopping."""

    def expiry_reason(self, t: Transfer) -> str:
        """Why `t`, not stopping, failed its deadline."""
        return f"timed out in state {t.state.value}"

    def on_stopping(self, t: Transfer) -> None:
        """`t` has just entered STOPPING (its pending copies are cancelled)."""

    def tell_stopped(self, t: Transfer) -> None:
        """Tell `t`'s peer that we stopped and it may let go (only when the stop says so)."""
        message = self.engine.messenger.release(t.transfer_id)
        if t.link.identity is not None:
            self.engine.messenger.notify(t.peer, message, t.link.identity)
        else:
            self.engine.messenger.send(t.peer, message)  # not bound yet: P holds (READ) or waits to write (WRITE) for us

    def may_fail(self, t: Transfer) -> bool:
        """STOPPING `t` has no pending copy: may it fail now (so its blocks are reused)?"""
        return True

    def before_fail(self, t: Transfer) -> None:
        """STOPPING `t` is about to fail."""

    def ignore(self, t: Transfer, message) -> None:
        logger.warning("pdserve: ignoring %s for %s transfer %s", type(message).__name__, t.side.value,
                       t.transfer_id)
