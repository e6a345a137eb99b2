"""`TransferHistory`: what the engine remembers of transfers it does not run, and how it answers
messages for them.

It keeps the ids that ended (so a late message never revives one, and a transfer that comes after
D's Release is dropped) and the messages that came before their transfer (bounded in number,
each with an expiry), which the engine applies when the transfer appears.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import NamedTuple

from pdserve.config import ConnectorConfig, Role
from pdserve.control.address import PeerAddress
from pdserve.control.messages import ReadDone, Release, RemoteBlocks, WriteDone
from pdserve.transfer.messenger import Messenger
from pdserve.transfer.specs import CancelSpec

MAX_TERMINAL_IDS = 4096
MAX_EARLY_IDS = 4096


class EarlyMessage(NamedTuple):
    expiry: float  # monotonic time after which it is dropped
    sender: str
    message: object
    received: float  # monotonic time the control-plane thread received it


class TransferHistory:
    def __init__(self, config: ConnectorConfig, messenger: Messenger):
        self._config = config
        self._messenger = messenger
        self.terminal: OrderedDict[str, PeerAddress | None] = OrderedDict()  # P WRITE: D's address
        self.early: OrderedDict[str, list[EarlyMessage]] = OrderedDict()

    def remember_terminal(self, tid: str, peer: PeerAddress | None = None) -> None:
        self.terminal[tid] = peer
        self.terminal.move_to_end(tid)
        while len(self.terminal) > MAX_TERMINAL_IDS:
            self.terminal.popitem(last=False)

    def take_early(self, tid: str) -> list[EarlyMessage]:
        return self.early.pop(tid, [])

    def early_subs(self, tid: str) -> list[str]:
        """Sub-transfer ids of `tid` (ranks.py) messages came for before it."""
        return [name for name in self.early if name.startswith(f"{tid}#")]

    def announced_early(self, tid: str) -> bool:
        """D's `RemoteBlocks` for `tid` came before its transfer."""
        return any(isinstance(item.message, RemoteBlocks) for item in self.early.get(tid, ()))

    def fence(self, spec: CancelSpec) -> bool:
        """The scheduler cancelled a transfer the engine does not run: fence its id (a transfer that
        comes later never runs); False when it was fenced already."""
        if spec.transfer_id in self.terminal:
            return False
        producer = self._config.role is Role.PRODUCER
        self.remember_terminal(spec.transfer_id, spec.peer if producer else None)
        self.take_early(spec.transfer_id)
        return True

    def letting_go(self, spec: CancelSpec):
        """What tells the peer's ranks to let go of `spec`'s transfer, under its own id."""
        if self._config.role is Role.PRODUCER:
            return WriteDone(spec.transfer_id, False, spec.reason)
        return self._messenger.release(spec.transfer_id)

    def fenced_subs(self, tid: str) -> list[str]:
        """Sub-transfer ids of `tid` (ranks.py) a peer let go of before it came."""
        return [name for name in self.terminal if name.startswith(f"{tid}#")]

    def on_message(self, tid: str, sender: str, message, received: float) -> None:
        """A message for a transfer we do not run (yet, or any more)."""
        if isinstance(message, Release) and self._config.role is Role.PRODUCER and message.reply_host:
            # D gave up on a transfer we have not seen (or already ended): fence it, so a send that
            # comes later never writes, and tell D at once that nothing of ours will touch its blocks.
            if tid not in self.terminal:
                self.remember_terminal(tid)
                self.take_early(tid)
            reply_to = PeerAddress(message.reply_host, 0, message.reply_notify_port)
            self._messenger.notify(reply_to, WriteDone(tid, False, f"prefill has no transfer {tid} in progress"),
                                   sender)
        elif tid in self.terminal:
            if isinstance(message, ReadDone):
                self._messenger.ack(sender, message, f"transfer {tid} is over: its KV was released or expired")
            elif isinstance(message, Release) and self.terminal[tid] is not None:
                # our WriteDone may have been lost: D waits for word that we will not write again
                self._messenger.notify(self.terminal[tid], WriteDone(tid, False, f"transfer {tid} is over"), sender)
        else:
            if tid not in self.early and len(self.early) >= MAX_EARLY_IDS:
                self.early.popitem(last=False)
            expiry = time.monotonic() + self._config.defer_timeout
            self.early.setdefault(tid, []).append(EarlyMessage(expiry, sender, message, received))

    def expire_early(self, now: float) -> None:
        """Drop the early messages whose expiry passed; a D waiting on a ReadDone hears no KV is held."""
        for tid, items in list(self.early.items()):
            for item in items:
                if item.expiry <= now and isinstance(item.message, ReadDone):
                    self._messenger.ack(item.sender, item.message,
                                        f"no KV is held for transfer {tid} (unknown or expired)")
            kept = [item for item in items if item.expiry > now]
            if kept:
                items[:] = kept
            else:
                del self.early[tid]
