"""`KindTable`: which unit runs each kind of transfer (kinds/), and the hooks the engine's parts call on it.

The units are registered once they are built (they need the parts that need this table); every
hook runs on the worker thread, with the transfer not terminal.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Protocol

from pdserve.config import TransferMode
from pdserve.transfer.peers import Peer
from pdserve.transfer.record import Side, Transfer

logger = logging.getLogger("pdserve.connector")


class TransferHooks(Protocol):
    """What one kind of transfer does at each event (kinds/base.py: `TransferKind`)."""

    def on_message(self, t: Transfer, sender: str, message, received: float) -> None: ...

    def on_peer(self, t: Transfer, peer: Peer) -> None: ...

    def on_bound(self, t: Transfer, peer: Peer) -> None: ...

    def on_rebind(self, t: Transfer) -> None: ...

    def copies_settled(self, t: Transfer) -> None: ...

    def expiry_reason(self, t: Transfer) -> str: ...

    def on_stopping(self, t: Transfer) -> None: ...

    def tell_stopped(self, t: Transfer) -> None: ...

    def may_fail(self, t: Transfer) -> bool: ...

    def before_fail(self, t: Transfer) -> None: ...


class KindTable:
    def __init__(self):
        self._kinds: dict[tuple[Side, TransferMode], TransferHooks] = {}

    def register(self, kinds: Mapping[tuple[Side, TransferMode], TransferHooks]) -> None:
        self._kinds.update(kinds)

    def of(self, t: Transfer) -> TransferHooks:
        """The unit that runs `t`'s kind of transfer."""
        return self._kinds[(t.side, t.mode)]

    def deliver(self, t: Transfer, sender: str, message, received: float) -> None:
        """Hand a peer's message to `t`'s kind, only from the incarnation `t` is bound to."""
        if t.side is Side.RECV and t.link.identity is None:
            t.link.deferred.append((sender, message, received))  # applied once we know which incarnation is ours
            return
        if t.link.identity is not None and sender != t.link.identity:
            logger.warning("pdserve: ignoring %s for transfer %s from %s: it is bound to %s",
                           type(message).__name__, t.transfer_id, sender, t.link.identity)
            return
        self.of(t).on_message(t, sender, message, received)
