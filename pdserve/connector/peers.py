"""The peers a worker moves KV with: one handshake per peer instance, cached until it changes.

A handshake runs on a background thread (it must never stall a forward pass); its result comes
back through the worker's inbox and is applied on the worker thread, which alone touches the
transport. A peer that restarted announces a new identity, which triggers a new handshake: the
old mapping would point at a dead instance's memory.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from enum import Enum
from typing import Callable

from pdserve.connector.layout import KvLayout
from pdserve.control.address import PeerAddress
from pdserve.errors import PDServeError
from pdserve.transport.base import RegionDescriptor, Transport

logger = logging.getLogger("pdserve.connector")

RETRY_AFTER_S = 1.0


class PeerState(Enum):
    CONNECTING = "connecting"
    READY = "ready"
    FAILED = "failed"


@dataclass
class Peer:
    address: PeerAddress
    state: PeerState = PeerState.CONNECTING
    identity: str = ""  # the peer instance's identity, from its handshake reply
    layout: KvLayout | None = None
    error: str = ""
    failed_at: float = 0.0

    @property
    def key(self) -> str:
        return f"{self.address.host}:{self.address.handshake_port}"


@dataclass(frozen=True)
class HandshakeResult:
    """What a handshake thread hands back: the peer's identity, regions and layout, or an error."""

    address: PeerAddress
    identity: str = ""
    regions: tuple[RegionDescriptor, ...] = ()
    layout: KvLayout | None = None
    error: str = ""


class PeerTable:
    """Called on the worker thread only. `handshake(address)` is run on a background thread and
    must return a HandshakeResult (errors included, never raising)."""

    def __init__(self, transport: Transport, handshake: Callable[[PeerAddress], HandshakeResult],
                 deliver: Callable[[HandshakeResult], None]):
        self._transport = transport
        self._handshake = handshake
        self._deliver = deliver
        self._peers: dict[PeerAddress, Peer] = {}
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="pdserve-handshake")

    def lookup(self, address: PeerAddress, identity: str | None = None) -> Peer:
        """The peer at `address`, starting a handshake when it is unknown, failed a while ago, or
        now answers with a different identity than the one we attached."""
        peer = self._peers.get(address)
        stale = peer is not None and peer.state is PeerState.READY and identity and identity != peer.identity
        retry = peer is not None and peer.state is PeerState.FAILED and time.monotonic() - peer.failed_at > RETRY_AFTER_S
        if peer is None or stale or retry:
            if stale:
                logger.info("pdserve: peer %s restarted (%s -> %s), handshaking again", address, peer.identity, identity)
            peer = Peer(address)
            self._peers[address] = peer
            self._pool.submit(self._run, address)
        return peer

    def _run(self, address: PeerAddress) -> None:
        try:
            result = self._handshake(address)
        except Exception as exc:  # a handshake thread must always report back
            result = HandshakeResult(address, error=f"handshake with {address.host}:{address.handshake_port} failed: {exc}")
        self._deliver(result)

    def apply(self, result: HandshakeResult) -> Peer | None:
        peer = self._peers.get(result.address)
        if peer is None or peer.state is not PeerState.CONNECTING:
            return peer
        if not result.error:
            try:
                self._transport.attach_peer(peer.key, list(result.regions))
            except PDServeError as exc:
                result = HandshakeResult(result.address, error=str(exc))
            except OSError as exc:
                result = HandshakeResult(result.address, error=f"cannot map the peer's KV memory: {exc}")
        if result.error:
            peer.state, peer.error, peer.failed_at = PeerState.FAILED, result.error, time.monotonic()
            logger.error("pdserve: %s", result.error)
        else:
            peer.state, peer.identity, peer.layout = PeerState.READY, result.identity, result.layout
            logger.info("pdserve: attached peer %s (%s)", peer.key, peer.identity)
        return peer

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        for peer in self._peers.values():
            self._transport.detach_peer(peer.key)
        self._peers.clear()
