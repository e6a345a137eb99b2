"""`Messenger`: every control message the engine sends leaves through here.

Only to allowed hosts, always to one peer incarnation; a message for a peer whose handshake is
still running waits in that peer's outbox until it ends.
"""

from __future__ import annotations

import logging
from typing import Protocol

from pdserve.config import ConnectorConfig
from pdserve.control.address import PeerAddress
from pdserve.control.messages import ReadAck, ReadDone, Release, WriteDone
from pdserve.transfer.allowlist import PeerAllowList
from pdserve.transfer.peers import Peer, PeerState, PeerTable

logger = logging.getLogger("pdserve.connector")

LETTING_GO = (Release, WriteDone)  # what still goes to a peer that refused our handshake: it frees its blocks


class Notifier(Protocol):
    def notify(self, address: PeerAddress, message, recipient: str) -> bool:
        """Queue a message for incarnation `recipient` at the peer's notify port; never blocks,
        never raises; False when it could not be queued."""

    def forget(self, address: PeerAddress) -> None:
        """Drop whatever is still queued for the peer at `address` (it restarted or was evicted)."""


class Messenger:
    def __init__(self, config: ConnectorConfig, notifier: Notifier, allow: PeerAllowList, peers: PeerTable):
        self._config = config
        self._notifier = notifier
        self._allow = allow
        self._peers = peers

    def notify(self, address: PeerAddress, message, recipient: str) -> bool:
        """Send to incarnation `recipient`; False when the host is not allowed or it could not be queued."""
        if not self._allow.allows(address.host):
            logger.error("pdserve: not sending %s: %s", type(message).__name__, self._allow.refusal(address.host))
            return False
        return self._notifier.notify(address, message, recipient)

    def send(self, address: PeerAddress | None, message) -> None:
        """Send to the current incarnation at `address` (after a handshake, if none yet)."""
        if address is None:
            return
        peer = self._peers.lookup(address)
        if peer.state is PeerState.READY:
            self.notify(address, message, peer.key)
        elif peer.state is PeerState.CONNECTING:
            peer.outbox.append(message)
        elif peer.refused_by and isinstance(message, LETTING_GO):
            self.notify(address, message, peer.refused_by)  # incompatible, yet it can let go of its blocks

    def broadcast(self, message) -> None:
        """Send to every peer with a finished handshake."""
        for peer in self._peers.ready():
            self.notify(peer.address, message, peer.key)

    def flush(self, peer: Peer) -> None:
        """`peer`'s handshake ended: send what waited for it (only letting-go messages if refused)."""
        for message in peer.outbox:
            if peer.state is PeerState.READY:
                self.notify(peer.address, message, peer.key)
            elif peer.refused_by and isinstance(message, LETTING_GO):
                self.notify(peer.address, message, peer.refused_by)
        peer.outbox.clear()

    def forget(self, address: PeerAddress) -> None:
        self._notifier.forget(address)

    def release(self, transfer_id: str) -> Release:
        """The `Release` that asks a peer to let go of `transfer_id`, answered to us."""
        return Release(transfer_id, self._config.host_ip, self._config.notify_port)

    def ack(self, sender: str, message: ReadDone, error: str, kv_digest: bytes = b"") -> None:
        """Answer D's `ReadDone`: ok when `error` is empty, with the digest of the held blocks."""
        reply_to = PeerAddress(message.reply_host, 0, message.reply_notify_port)
        self.notify(reply_to, ReadAck(message.transfer_id, not error, error, kv_digest), sender)
