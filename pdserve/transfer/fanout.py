"""`Fanout`: one request's transfer, split into the sub-transfers of this rank's rank pairs (the
engine opens them; groups.py joins their endings into one report).

Between instances of tensor-parallel sizes Tp and Td each rank moves only its pairs' heads
(ranks.py). A send or receive needs the peer instance's TP size, which its handshake answers (the
peer's rank 0 listens at the address the request names): until then the spec is parked, bounded
by the handshake's own deadline. A P hold (READ) learns D's size from the first sub-transfer id a
D rank names, and splits then. A request ends on this rank once every sub-transfer of it ended;
it failed if any did. Between TP 1 instances a transfer has one sub-transfer, with its own id.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import NamedTuple

from pdserve.config import ConnectorConfig, TransferMode
from pdserve.control.address import PeerAddress
from pdserve.control.messages import Release, WriteDone
from pdserve.transfer.endings import Endings
from pdserve.transfer.groups import Groups
from pdserve.transfer.messenger import Messenger
from pdserve.transfer.peers import Peer, PeerState, PeerTable
from pdserve.transfer.ranks import Ranks, Slicing, coverer, pairs_for, parse_sub_id, rank_address, sub_id
from pdserve.transfer.record import RELEASED_BY_DECODE, Side, Transfer
from pdserve.transfer.specs import CancelSpec, RecvSpec, SendSpec

logger = logging.getLogger("pdserve.connector")


MAX_WAITING_WORDS = 4096  # letting-go messages waiting for a handshake (each answers within its deadline)


@dataclass
class Parked:
    """A send or receive waiting for its peer instance's TP size."""

    spec: SendSpec | RecvSpec
    step: int  # the engine step it was added in
    arrived: float  # monotonic: its sub-transfers' deadlines count from here
    deadline: float  # monotonic: past it, it goes on as if the peer had TP 1 (and fails on it)


class Opening(NamedTuple):
    """A sub-transfer to open: `spec`'s part with one peer rank (the engine opens it)."""

    spec: SendSpec | RecvSpec
    transfer_id: str
    peer: PeerAddress
    slicing: Slicing | None
    group: str  # the transfer's own id
    step: int  # the engine step `spec` was added in
    deadline: float  # monotonic


class Fanout:
    def __init__(self, config: ConnectorConfig, ranks: Ranks, peers: PeerTable, messenger: Messenger, groups: Groups,
                 running: dict[str, Transfer], endings: Endings):
        self._config = config
        self.ranks = ranks
        self._peers = peers
        self._messenger = messenger
        self._groups = groups
        self._running = running  # transfer id -> transfer, shared with the engine
        self._endings = endings
        self._parked: list[Parked] = []
        self._letting_go: list[tuple[PeerAddress, object]] = []  # (instance, message) waiting for its size

    # ---- splitting -------------------------------------------------------------------------

    def in_use(self, transfer_id: str) -> bool:
        """Whether a send or receive of `transfer_id` was split or waits to be."""
        return transfer_id in self._groups or any(p.spec.transfer_id == transfer_id for p in self._parked)

    def add(self, spec: SendSpec | RecvSpec, step: int) -> list[Opening]:
        """Split `spec` into the sub-transfers to open now, or park it until its peer's size is known."""
        size = self._peer_size(spec.peer)
        now = time.monotonic()
        if size is None:
            limit = self._config.handshake_timeout + 1.0
            if isinstance(spec, RecvSpec):
                limit = min(limit, self._config.transfer_timeout)
            self._parked.append(Parked(spec, step, now, now + limit))
            return []
        return self._split(spec, size, step, now)

    def on_peer(self, peer: Peer) -> list[Opening]:
        """A handshake ended: split what waited for that instance's size, tell its ranks what waited."""
        waiting_words = [(base, message) for base, message in self._letting_go if base == peer.address]
        if waiting_words:
            self._letting_go = [(base, message) for base, message in self._letting_go if base != peer.address]
            for base, message in waiting_words:
                self.tell_every_rank(base, message)
        waiting = [p for p in self._parked if p.spec.peer == peer.address]
        if waiting:
            self._parked = [p for p in self._parked if p.spec.peer != peer.address]
        return [o for parked in waiting
                for o in self._split(parked.spec, self._peer_size(parked.spec.peer) or 1, parked.step, parked.arrived)]

    def expire(self, now: float) -> list[Opening]:
        late = [p for p in self._parked if now > p.deadline]
        if late:
            self._parked = [p for p in self._parked if now <= p.deadline]
        return [o for parked in late for o in self._split(parked.spec, 1, parked.step, parked.arrived)]

    def _peer_size(self, base: PeerAddress) -> int | None:
        peer = self._peers.lookup(base)
        if peer.state is PeerState.READY:
            return peer.ranks.size
        if peer.state is PeerState.FAILED:
            return 1  # its sub-transfers fail on it, naming why
        return None

    def _split(self, spec: SendSpec | RecvSpec, peer_size: int, step: int, arrived: float) -> list[Opening]:
        sending = isinstance(spec, SendSpec)
        prefill_size, decode_size = (self.ranks.size, peer_size) if sending else (peer_size, self.ranks.size)
        pairs = pairs_for(self.ranks, peer_size, local_is_prefill=sending)
        self._groups.open(spec.transfer_id, spec.request_id, Side.SEND if sending else Side.RECV, len(pairs))
        peer_heads = Ranks(0, peer_size, self.ranks.total_heads).local_heads
        timeout = self._config.defer_timeout if sending else self._config.transfer_timeout
        openings = []
        for pair in pairs:
            tid = sub_id(spec.transfer_id, pair.prefill, prefill_size, pair.decode, decode_size)
            address = rank_address(spec.peer, pair.decode if sending else pair.prefill)
            slicing = None if pair.heads is None else Slicing(pair.heads, self.ranks.local_heads, peer_heads)
            openings.append(Opening(spec, tid, address, slicing, spec.transfer_id, step, arrived + timeout))
        if not sending and spec.mode is TransferMode.READ:
            self._cover(spec, peer_size)  # other P ranks than the ones opened here: the order does not matter
        if not pairs:
            self._groups.end(spec.transfer_id)
        return openings

    def _cover(self, spec: RecvSpec, prefill_size: int) -> None:
        """READ: P ranks no D rank reads from are told to let go by one D rank each."""
        prefill = Ranks(0, prefill_size, self.ranks.total_heads)
        for p in range(prefill_size):
            if coverer(prefill, self.ranks.size, p) == self.ranks.rank:
                tid = sub_id(spec.transfer_id, p, prefill_size, self.ranks.rank, self.ranks.size)
                self._messenger.send(rank_address(spec.peer, p), self._messenger.release(tid))

    def split_hold(self, name: str) -> tuple[Transfer, list[tuple[str, Slicing | None]]] | None:
        """P READ: a D rank named sub-transfer `name` of a prompt we hold whole: the hold to split
        into this rank's sub-transfers with D's ranks, and those (id, heads) (the engine replaces
        the hold by them); None when `name` names no such hold of ours."""
        sub = parse_sub_id(name)
        if sub is None:
            return None
        parent = self._running.get(sub.transfer_id)
        if parent is None or parent.side is not Side.SEND or parent.mode is not TransferMode.READ or parent.group:
            return None
        if (sub.prefill, sub.prefill_size) != (self.ranks.rank, self.ranks.size):
            logger.warning("pdserve: ignoring sub-transfer %s: this is rank %d of %d", name, self.ranks.rank,
                           self.ranks.size)
            return None
        pairs = pairs_for(self.ranks, sub.decode_size, local_is_prefill=True)
        peer_heads = Ranks(0, sub.decode_size, self.ranks.total_heads).local_heads
        readers = [(p.decode, None if p.heads is None else Slicing(p.heads, self.ranks.local_heads, peer_heads))
                   for p in pairs] or [(coverer(self.ranks, sub.decode_size, self.ranks.rank), None)]
        self._groups.open(parent.transfer_id, parent.request_id, Side.SEND, len(readers))
        return parent, [(sub_id(parent.transfer_id, self.ranks.rank, self.ranks.size, d, sub.decode_size), slicing)
                        for d, slicing in readers]

    # ---- endings ----------------------------------------------------------------------------

    def tell_every_rank(self, base: PeerAddress | None, message) -> None:
        """Send a letting-go message under a transfer's own id to every rank of the peer instance
        (once its size is known: a handshake with its rank 0 may have to answer first); nobody
        when the transfer names no peer (its params were malformed)."""
        if base is None:
            return
        size = self._peer_size(base)
        if size is None:
            self._letting_go = [*self._letting_go[-MAX_WAITING_WORDS + 1:], (base, message)]
            return
        for rank in range(size):
            self._messenger.send(rank_address(base, rank), message)

    def let_go_of_group(self, transfer_id: str, message) -> bool:
        """A peer rank let go (Release, or WriteDone not ok) of a transfer under its own id, which
        this rank runs as sub-transfers: stop them all (each tells its own peer rank)."""
        if transfer_id not in self._groups or not isinstance(message, (Release, WriteDone)) or \
                (isinstance(message, WriteDone) and message.ok):
            return False
        reason = RELEASED_BY_DECODE if isinstance(message, Release) else \
            f"prefill could not deliver the KV: {message.error}"
        for t in list(self._running.values()):
            if t.group == transfer_id:
                self._endings.stop(t, reason, tell_peer=True)
        return True

    def cancel(self, spec: CancelSpec) -> bool:
        """Stop every sub-transfer of `spec`'s transfer (or drop it parked); False if none is known."""
        parked = [p for p in self._parked if p.spec.transfer_id == spec.transfer_id]
        if parked:
            self._parked = [p for p in self._parked if p.spec.transfer_id != spec.transfer_id]
            side = Side.SEND if isinstance(parked[0].spec, SendSpec) else Side.RECV
            self._groups.failed_unsplit(parked[0].spec.request_id, side)
            return False  # the peer is still told (history.py: fence), under the transfer's own id
        if spec.transfer_id not in self._groups:
            return False
        for t in list(self._running.values()):
            if t.group == spec.transfer_id:
                self._endings.stop(t, spec.reason, tell_peer=True)
        return True

    def parked_sends(self) -> set[str]:
        """Requests whose send waits to be split: vLLM must keep their blocks."""
        return {p.spec.request_id for p in self._parked if isinstance(p.spec, SendSpec)}
