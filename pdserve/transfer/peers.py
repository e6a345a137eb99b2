"""The peers a worker moves KV with: one handshake per peer incarnation, cached until it changes.

A handshake runs on a background thread (it must never stall a forward pass); its result comes
back through the worker's inbox and is applied on the worker thread, which alone touches the
transport. A peer is reached through its address but *is* an incarnation: the transport maps its
memory under the incarnation's identity, so a restarted peer (a new identity at the same address)
gets a new mapping and nothing queued for the old one can land in it. Addresses outside the
allow-list are refused without a handshake; a peer nobody used for `idle_s` is forgotten.

Handshakes never queue behind one another (handshakes.py): an address that nobody listens on fails
at once, one that never answers holds a thread of its own until `handshake_timeout`, and when too
many addresses never met are pending, another one fails at once instead of waiting. An address that
failed is not tried again for RETRY_AFTER_S; one that completed a handshake before is always tried,
so a peer that restarts at its address is met again whatever else is pending.

A peer that answers but refuses (an incompatible KV layout) is FAILED with `refused_by` set: no KV
can move between us until one side restarts, so transfers with it end at once, but the messages
that let go of blocks (Release, WriteDone) still reach that incarnation, so it frees them at once too.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum

from pdserve.control.address import PeerAddress
from pdserve.errors import PDServeError
from pdserve.transfer.allowlist import PeerAllowList
from pdserve.transfer.handshakes import HandshakeThreads
from pdserve.transfer.incarnation import Incarnation
from pdserve.transfer.layout import KvLayout
from pdserve.transfer.ranks import SINGLE, Ranks
from pdserve.transport.base import RegionDescriptor, Transport
from pdserve.transport.nixl_auto import PeerRoute

logger = logging.getLogger("pdserve.connector")

RETRY_AFTER_S = 1.0  # a failed address is not handshaken again sooner
MAX_STRANGER_HANDSHAKES = 64  # in flight at once with addresses that never completed a handshake
MAX_KNOWN_ADDRESSES = 256  # addresses remembered as having completed a handshake
CLOSE_DEADLINE_S = 1.0


class PeerState(Enum):
    CONNECTING = "connecting"
    READY = "ready"
    FAILED = "failed"


@dataclass
class Peer:
    address: PeerAddress
    state: PeerState = PeerState.CONNECTING
    incarnation: Incarnation | None = None
    layout: KvLayout | None = None
    error: str = ""
    failed_at: float = 0.0
    last_used: float = field(default_factory=time.monotonic)
    outbox: list = field(default_factory=list)  # messages for whichever incarnation the handshake finds
    refused_by: str = ""  # FAILED: the incarnation that answered and refused (incompatible), if one did
    refreshing: bool = False  # a new handshake checks whether another incarnation listens now
    ranks: Ranks = SINGLE  # READY: its tensor-parallel layout (its instance's size, this rank)

    @property
    def key(self) -> str:
        """The transport's peer id and the recipient of our messages: the incarnation identity."""
        return self.incarnation.identity if self.incarnation is not None else ""


@dataclass(frozen=True)
class HandshakeResult:
    """What a handshake thread hands back: the peer's incarnation, regions and layout, or an error."""

    address: PeerAddress
    incarnation: Incarnation | None = None
    regions: tuple[RegionDescriptor, ...] = ()
    layout: KvLayout | None = None
    error: str = ""
    route: PeerRoute | None = None  # how to reach it (same host or NIXL), for a RoutedTransport
    refused_by: str = ""  # with `error`: the incarnation that answered but is incompatible (no retry helps)
    ranks: Ranks = SINGLE


class PeerTable:
    """Called on the worker thread only. `handshake(address)` is run on a background thread and
    must return a HandshakeResult (errors included, never raising)."""

    def __init__(self, transport: Transport, handshake: Callable[[PeerAddress], HandshakeResult],
                 deliver: Callable[[HandshakeResult], None], allow: PeerAllowList, idle_s: float):
        self._transport = transport
        self._handshake = handshake
        self._deliver = deliver
        self._allow = allow
        self._idle_s = idle_s
        self._peers: dict[PeerAddress, Peer] = {}
        self._threads = HandshakeThreads(self._run, deliver, MAX_STRANGER_HANDSHAKES)
        self._known: OrderedDict[PeerAddress, None] = OrderedDict()  # least recently met first

    def lookup(self, address: PeerAddress) -> Peer:
        """The peer at `address`, starting a handshake when it is unknown or failed a while ago."""
        peer = self._peers.get(address)
        if peer is not None and peer.state is PeerState.FAILED and time.monotonic() - peer.failed_at > RETRY_AFTER_S:
            peer = None
        if peer is None:
            peer = Peer(address)
            self._peers[address] = peer
            refusal = self._start(address) if self._allow.allows(address.host) else self._allow.refusal(address.host)
            if refusal:  # fail now, naming the address: what needs this peer fails instead of waiting
                peer.state, peer.error, peer.failed_at = PeerState.FAILED, refusal, time.monotonic()
        peer.last_used = time.monotonic()
        return peer

    def ready(self) -> list[Peer]:
        """Peers with a live, attached incarnation."""
        return [peer for peer in self._peers.values() if peer.state is PeerState.READY]

    def refresh(self, address: PeerAddress) -> None:
        """Handshake the ready peer at `address` again (it may have restarted); until the answer
        comes, the current incarnation stays attached."""
        peer = self._peers.get(address)
        if peer is not None and peer.state is PeerState.READY and not peer.refreshing:
            peer.refreshing = not self._start(address)

    @property
    def num_handshakes(self) -> int:
        """Handshakes in flight now."""
        return self._threads.num_running

    def _start(self, address: PeerAddress) -> str:
        return self._threads.start(address, known=address in self._known)

    def drop(self, address: PeerAddress) -> None:
        """Forget the peer at `address` and unmap its memory (its incarnation is gone)."""
        peer = self._peers.pop(address, None)
        if peer is not None:
            self._detach(peer)

    def _run(self, address: PeerAddress) -> HandshakeResult:
        try:
            return self._handshake(address)
        except Exception as exc:  # noqa: BLE001 - a handshake thread must always report back
            return HandshakeResult(address, error=f"handshake with {_where(address)} failed: {exc}")

    def apply(self, result: HandshakeResult) -> Peer | None:
        peer = self._peers.get(result.address)
        if peer is None:
            return None
        if peer.refreshing:
            return self._apply_refresh(peer, result)
        if peer.state is not PeerState.CONNECTING:
            return None
        result = self._attach(result)
        if result.error:
            peer.state, peer.error, peer.failed_at = PeerState.FAILED, result.error, time.monotonic()
            peer.refused_by = result.refused_by
            logger.error("pdserve: %s", result.error)
        else:
            peer.state, peer.incarnation, peer.layout = PeerState.READY, result.incarnation, result.layout
            peer.ranks = result.ranks
            self._met(peer.address)
            logger.info("pdserve: attached peer %s (%s) over %s", peer.key, _where(peer.address), self._over(peer))
        return peer

    def _apply_refresh(self, peer: Peer, result: HandshakeResult) -> Peer:
        peer.refreshing = False
        if result.error or result.incarnation.identity == peer.key:
            return peer  # nobody new there: transfers that wanted another incarnation now fail
        result = self._attach(result)
        if result.error:
            return peer
        logger.info("pdserve: peer %s restarted: %s -> %s", _where(peer.address), peer.key, result.incarnation.identity)
        self._detach(peer)
        peer.incarnation, peer.layout, peer.ranks = result.incarnation, result.layout, result.ranks
        self._met(peer.address)
        return peer

    def _met(self, address: PeerAddress) -> None:
        self._known[address] = None
        self._known.move_to_end(address)
        if len(self._known) > MAX_KNOWN_ADDRESSES:
            self._known.popitem(last=False)

    def _attach(self, result: HandshakeResult) -> HandshakeResult:
        if result.error:
            return result
        try:
            if result.route is None:
                self._transport.attach_peer(result.incarnation.identity, list(result.regions))
            else:
                self._transport.attach_peer(result.incarnation.identity, list(result.regions), result.route)
        except PDServeError as exc:
            return HandshakeResult(result.address, error=str(exc))
        except OSError as exc:
            return HandshakeResult(result.address, error=f"cannot map the peer's KV memory: {exc}")
        return result

    def gone(self) -> list[Peer]:
        """Remove and return the ready peers whose incarnation provably died (same host only)."""
        dead = [p for p in self._peers.values() if p.state is PeerState.READY and p.incarnation.is_gone()]
        for peer in dead:
            logger.info("pdserve: peer %s (%s) is gone", peer.key, _where(peer.address))
            del self._peers[peer.address]
            self._detach(peer)
        return dead

    def evict_idle(self, busy: set[PeerAddress]) -> list[Peer]:
        """Forget peers that no transfer used for `idle_s`; returns them."""
        cutoff = time.monotonic() - self._idle_s
        idle = [p for a, p in self._peers.items()
                if a not in busy and p.state is not PeerState.CONNECTING and p.last_used < cutoff]
        for peer in idle:
            del self._peers[peer.address]
            self._detach(peer)
        return idle

    def __len__(self) -> int:
        return len(self._peers)

    def _over(self, peer: Peer) -> str:
        transport_of = getattr(self._transport, "transport_of", None)
        return (transport_of(peer.key) if transport_of is not None else None) or "shm"

    def _detach(self, peer: Peer) -> None:
        if peer.incarnation is not None:
            self._transport.detach_peer(peer.key)

    def close(self) -> None:
        """No handshake starts after this; running ones are joined for up to CLOSE_DEADLINE_S
        (closing the control client first ends them at once)."""
        self._threads.close(CLOSE_DEADLINE_S)
        for peer in self._peers.values():
            self._detach(peer)
        self._peers.clear()


def _where(address: PeerAddress) -> str:
    return f"{address.host}:{address.handshake_port}"
