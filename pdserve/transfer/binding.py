"""`PeerBinding`: which peer incarnation each transfer talks to, and what happens when it dies.

A transfer is bound to the incarnation at its peer's address the first time it talks to or
copies with it. A different incarnation there later is first taken for a stale view (the address
is handshaken again once), then fences the transfer; a bound incarnation that provably died
stops every transfer bound to it without telling it (a dead process copies nothing more).
"""

from __future__ import annotations

import time

from pdserve.control.address import PeerAddress
from pdserve.transfer.allowlist import PeerAllowList
from pdserve.transfer.completions import TransferStats
from pdserve.transfer.endings import Endings
from pdserve.transfer.hooks import KindTable
from pdserve.transfer.messenger import Messenger
from pdserve.transfer.peers import Peer, PeerState, PeerTable
from pdserve.transfer.record import Transfer

LIVENESS_EVERY_S = 0.5


class PeerBinding:
    def __init__(self, peers: PeerTable, allow: PeerAllowList, messenger: Messenger, stats: TransferStats,
                 endings: Endings, kinds: KindTable, running: dict[str, Transfer]):
        self._peers = peers
        self._allow = allow
        self._messenger = messenger
        self._stats = stats
        self._endings = endings
        self._kinds = kinds
        self._running = running  # transfer id -> transfer, shared with the engine
        self._next_check = 0.0  # monotonic: when `check_peers` looks again

    def prepare(self, t: Transfer) -> None:
        """P: handshake `t`'s peer while the forward pass runs; a refused peer fails `t` now
        (naming the reason), not at its deadline."""
        peer = self._peers.lookup(t.peer)
        if peer.state is PeerState.FAILED and (peer.refused_by or not self._allow.allows(t.peer.host)):
            self.bound_peer(t)

    def bound_peer(self, t: Transfer) -> Peer | None:
        """The ready peer of `t`'s incarnation, or None (waiting for a handshake, or failed)."""
        peer = self._peers.lookup(t.peer)
        if peer.state is PeerState.FAILED:
            if not self._allow.allows(t.peer.host):
                self._stats.num_refused += 1
            self._endings.stop(t, peer.error, tell_peer=True)
            return None
        if peer.state is not PeerState.READY or peer.refreshing:
            return None
        if peer.incarnation.is_gone():
            self.peer_gone(peer.address, peer.key)
            if not t.state.is_terminal:
                self._peers.lookup(t.peer)  # handshake whoever listens there now; on_peer resumes t
            return None
        if t.link.identity is None or t.link.identity == peer.key:
            return peer
        if not t.link.refreshed:  # our view may be stale: the peer at that address may have restarted
            t.link.refreshed = True
            self._peers.refresh(t.peer)
            return None
        self._stats.num_fenced += 1
        self._endings.stop(t, f"peer incarnation {t.link.identity} is gone ({peer.key} listens there now)", tell_peer=False)
        return None

    def bind(self, t: Transfer) -> None:
        """D: bind `t` to its peer's current incarnation, apply what waited for that, and start."""
        kind = self._kinds.of(t)
        if t.link.identity is not None:
            kind.on_rebind(t)
            return
        peer = self.bound_peer(t)
        if peer is None:
            return
        t.link.identity, t.link.incarnation = peer.key, peer.incarnation
        deferred, t.link.deferred = t.link.deferred, []
        for sender, message, received in deferred:  # e.g. P's WriteDone(ok=False): then nothing is announced
            if not t.state.is_terminal:
                self._kinds.deliver(t, sender, message, received)
        if not t.state.is_terminal and not t.stopping:
            kind.on_bound(t, peer)

    def on_peer(self, peer: Peer) -> None:
        """A handshake ended: send what waited for it and resume the transfers with that peer."""
        self._messenger.flush(peer)
        for t in list(self._running.values()):
            if t.peer == peer.address and not t.state.is_terminal:
                self._kinds.of(t).on_peer(t, peer)

    def check_peers(self, now: float) -> None:
        """Every LIVENESS_EVERY_S: fence the transfers of incarnations that died; close idle peers'
        connections."""
        if now < self._next_check:
            return
        self._next_check = now + LIVENESS_EVERY_S
        for peer in self._peers.gone():
            self.peer_gone(peer.address, peer.key, already_removed=True)
        busy = {t.peer for t in list(self._running.values()) if t.peer is not None}
        for peer in self._peers.evict_idle(busy):
            self._messenger.forget(peer.address)

    def peer_gone(self, address: PeerAddress, identity: str, already_removed: bool = False) -> None:
        """Incarnation `identity` died: nothing of it can copy any more; fail what was bound to it."""
        if not already_removed:
            self._peers.drop(address)
        self._messenger.forget(address)
        for t in list(self._running.values()):
            if t.link.identity == identity and not t.state.is_terminal:
                self._stats.num_fenced += 1
                if t.window is not None:
                    t.window.fence = time.monotonic()  # a dead process writes nothing
                self._endings.stop(t, f"peer incarnation {identity} died", tell_peer=False)
