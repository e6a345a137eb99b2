"""`TransferKind`: what one kind of transfer does at each event the engine hands it.

The engine's parts call these hooks (hooks.py) on the worker thread, with the transfer not
terminal; a hook drives the transfer through its transitions (record.py) with the collaborators
its kind was built with: `Endings` to stop or finish it, `Messenger` to talk to the peer, and per
kind `PeerBinding` (the peer incarnation it is bound to), `Copier`, `Verifier`. The defaults do
nothing.
"""

from __future__ import annotations

import logging

from pdserve.transfer.endings import Endings
from pdserve.transfer.messenger import Messenger
from pdserve.transfer.peers import Peer
from pdserve.transfer.record import Transfer

logger = logging.getLogger("pdserve.connector")


class TransferKind:
    def __init__(self, messenger: Messenger, endings: Endings):
        self._messenger = messenger
        self._endings = endings

    def on_message(self, t: Transfer, sender: str, message, received: float) -> None:
        """A message from the incarnation `t` is bound to (or from its peer, before binding on P)."""

    def on_peer(self, t: Transfer, peer: Peer) -> None:
        """A handshake with `t`'s peer ended (`peer` READY, or FAILED and maybe refused)."""
        if peer.refused_by:
            self._endings.stop(t, peer.error, tell_peer=True)  # incompatible: it will never take part

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
        message = self._messenger.release(t.transfer_id)
        if t.link.identity is not None:
            self._messenger.notify(t.peer, message, t.link.identity)
        else:
            self._messenger.send(t.peer, message)  # not bound yet: P holds (READ) or waits to write (WRITE) for us

    def may_fail(self, t: Transfer) -> bool:
        """STOPPING `t` has no pending copy: may it fail now (so its blocks are reused)?"""
        return True

    def before_fail(self, t: Transfer) -> None:
        """STOPPING `t` is about to fail."""

    def ignore(self, t: Transfer, message) -> None:
        logger.warning("pdserve: ignoring %s for %s transfer %s", type(message).__name__, t.side.value,
                       t.transfer_id)
