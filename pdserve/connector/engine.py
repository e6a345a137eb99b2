"""TransferEngine: drives every transfer of one worker, free of vLLM.

The worker half feeds it what the scheduler decided (`add_send`, `add_hold`, `add_recv`,
`cancel`), what the forward pass did (`layer_ready`), and what peers said (`on_message`, from
the control-plane threads), then asks `take_finished` which requests are done. Everything but
`on_message` runs on the worker thread, so transfer objects need no locks.

Failure rules enforced here:
- every transfer has a deadline; a terminal transfer ignores late messages; a message that
  arrives before its transfer is known is held (with a deadline) and applied when it appears;
- a transfer is bound to one peer incarnation: messages from any other are ignored, copies go
  only to that incarnation's mapping, and a restart or death of that incarnation fails it;
- both sides must name the same prompt (digest) and the same number of blocks;
- D never reports success unless every byte landed, and never reports failure (which lets vLLM
  reuse or recompute into the blocks) while P could still write them: only after P confirmed it
  stopped, P's incarnation provably died, or P's write window has provably closed (below).

The write window (WRITE mode) is a duration, never a time compared across hosts. D announces its
blocks at `announced_at` (its monotonic clock, taken before the message is queued) granting
`write_for` seconds; P, receiving it at `received` (its monotonic clock, stamped by the
control-plane thread), gives every copy the deadline `not_after = received + write_for - margin`
(margin = min(WRITE_MARGIN_S, write_for / 10)), and its transport lets no byte land after a
copy's deadline (transport/base.py: stopped between chunks, aborted in flight, or counted as
still copying when that cannot be confirmed). D's fence is `announced_at + write_for +
release_grace`. As `received = announced_at + transit`, P's last byte lands by `announced_at +
write_for + transit - margin`, which is before D's fence whenever transit < release_grace +
margin: the assumption is that an announcement reaches P's control-plane thread within
release_grace (2 s by default) of being queued; clock skew between the hosts plays no part. A P on
this host that provably lives is not trusted to the fence alone (it may be frozen mid-copy): D
waits for its word until it has run on the CPU since the fence (see `_may_still_copy`).
"""

from __future__ import annotations

import logging
import queue
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Protocol

from pdserve.config import ConnectorConfig, Role, TransferMode
from pdserve.connector.allowlist import PeerAllowList
from pdserve.connector.layout import KvLayout
from pdserve.connector.metadata import AwaitSpec, CancelSpec, HoldSpec, RecvSpec, SendSpec
from pdserve.connector.peers import HandshakeResult, Peer, PeerState, PeerTable
from pdserve.connector.transfer import Side, Transfer, TransferState
from pdserve.control.address import PeerAddress
from pdserve.control.messages import ReadAck, ReadDone, Release, RemoteBlocks, WriteDone
from pdserve.errors import PDServeError
from pdserve.placement.inbox import PlacementInbox, WorkerNews
from pdserve.placement.messages import DecodeStatus, PrefillLoad
from pdserve.transport.base import Direction, Transport, TransferStatus

logger = logging.getLogger("pdserve.connector")

LETTING_GO = (Release, WriteDone)  # what still goes to a peer that refused our handshake: it frees its blocks

WRITE_MARGIN_S = 0.25  # P ends its write window this much (at most a tenth of it) before D's grant ends
MAX_TERMINAL_IDS = 4096
MAX_EARLY_IDS = 4096
LIVENESS_EVERY_S = 0.5
RELEASED_BY_DECODE = "decode released the transfer"  # D gave up on it, or prefills the prompt itself


class Notifier(Protocol):
    def notify(self, address: PeerAddress, message, recipient: str) -> bool:
        """Queue a message for incarnation `recipient` at the peer's notify port; never blocks,
        never raises; False when it could not be queued."""

    def forget(self, address: PeerAddress) -> None:
        """Drop whatever is still queued for the peer at `address` (it restarted or was evicted)."""


@dataclass
class Finished:
    sending: set[str] = field(default_factory=set)
    recving: set[str] = field(default_factory=set)
    failed_recving: set[str] = field(default_factory=set)


@dataclass
class TransferStats:
    num_completed: int = 0
    num_failed: int = 0
    num_bytes: int = 0
    seconds: list[float] = field(default_factory=list)  # per completed transfer: announced/held -> done
    transfer_bytes: list[int] = field(default_factory=list)  # per completed transfer, in `seconds`' order
    copy_seconds: float = 0.0  # time the transport spent copying (sum over batches)
    copy_bytes: int = 0  # bytes this side's transport copied
    num_fenced: int = 0  # transfers failed because their peer incarnation restarted or died
    num_refused: int = 0  # transfers refused because their peer is not in allowed_peers


class TransferEngine:
    def __init__(self, config: ConnectorConfig, layout: KvLayout, transport: Transport,
                 notifier: Notifier, handshake: Callable[[PeerAddress], HandshakeResult]):
        self._config = config
        self._layout = layout
        self._transport = transport
        self._notifier = notifier
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._allow = PeerAllowList(config.allowed_peers)
        self._peers = PeerTable(transport, handshake, self._inbox.put, self._allow, config.peer_idle_timeout)
        self._transfers: dict[str, Transfer] = {}
        self._early: OrderedDict[str, list[tuple[float, str, object]]] = OrderedDict()
        self._terminal: OrderedDict[str, PeerAddress | None] = OrderedDict()  # P WRITE: D's address
        self._step_sends: list[Transfer] = []
        self._finished_requests: set[str] = set()
        self._sent: set[str] = set()  # request ids whose send side is over, not yet reported
        self._finished = Finished()
        self._next_liveness = 0.0
        self._placement = PlacementInbox(config.defer_timeout)
        self.stats = TransferStats()

    # ---- inputs ----------------------------------------------------------------------------

    def on_message(self, sender: str, message) -> None:
        """Thread-safe: called by control-plane server threads with an authenticated message."""
        self._inbox.put((sender, message, time.monotonic()))

    def begin_step(self) -> None:
        self._step_sends = []

    def add_send(self, spec: SendSpec) -> None:
        t = Transfer(spec.transfer_id, spec.request_id, Side.SEND, TransferMode.WRITE, spec.peer,
                     spec.block_ids, time.monotonic() + self._config.defer_timeout, prompt_hash=spec.prompt_hash)
        if self._admit(t) and not t.state.is_terminal:
            self._step_sends.append(t)
            peer = self._peers.lookup(t.peer)  # handshake while the forward pass runs
            if peer.state is PeerState.FAILED and (peer.refused_by or not self._allow.allows(t.peer.host)):
                self._bound_peer(t)  # refused: fail now (naming the reason), not at defer_timeout

    def add_hold(self, spec: HoldSpec) -> None:
        deadline = time.monotonic() + max(0.0, spec.expires_at - time.time())
        t = Transfer(spec.transfer_id, spec.request_id, Side.SEND, TransferMode.READ, None, spec.block_ids, deadline,
                     prompt_hash=spec.prompt_hash)
        self._admit(t)

    def add_recv(self, spec: RecvSpec) -> None:
        t = Transfer(spec.transfer_id, spec.request_id, Side.RECV, spec.mode, spec.peer, spec.block_ids,
                     time.monotonic() + self._config.transfer_timeout, spec.remote_block_ids, spec.first_block,
                     prompt_hash=spec.prompt_hash)
        if spec.error:
            t.fail(spec.error)
            self._finish(t, track=False)
            return
        t.hold_expires_at = spec.hold_expires_at
        if self._admit(t) and not t.state.is_terminal:
            self._bind(t)

    def cancel(self, spec: CancelSpec) -> None:
        """The scheduler decided this transfer will not happen (or must stop: a preempted
        prefill's blocks are already freed): stop it and tell the peer to let go."""
        t = self._transfers.get(spec.transfer_id)
        if t is not None:
            self._stop(t, spec.reason, tell_peer=True)
            return
        if spec.transfer_id in self._terminal:
            return
        self._remember_terminal(spec.transfer_id, spec.peer if self._config.role is Role.PRODUCER else None)
        self._early.pop(spec.transfer_id, None)
        if self._config.role is Role.PRODUCER:
            self._send(spec.peer, WriteDone(spec.transfer_id, False, spec.reason))
        else:
            self._send(spec.peer, self._release(spec.transfer_id))

    def await_decision(self, spec: AwaitSpec) -> None:
        """P, adaptive placement: the prefill leg of `spec` waits for D's word (see PlacementInbox)."""
        tid = spec.transfer_id
        if tid in self._terminal or tid in self._transfers:
            known = False if tid in self._terminal else True
        elif any(isinstance(item[2], RemoteBlocks) for item in self._early.get(tid, ())):
            known = True
        else:
            known = None
            self._peers.lookup(spec.peer)  # handshake D now: its blocks and our load reports need it
        self._placement.expect(spec.request_id, spec.transfer_id, known)

    def publish_load(self, load: PrefillLoad) -> None:
        """P: tell every decode instance we know how busy we are (rate-limited, but at once when
        the queue D counts on changed)."""
        if not self._placement.publish_due((load.queued_tokens, tuple(load.counted_transfers), load.decodes)):
            return
        for peer in self._peers.ready():
            self._notify(peer.address, load, peer.key)

    def publish_status(self, status: DecodeStatus) -> None:
        """D, READ: tell every prefill instance we know our side of its placement decisions (rate-limited)."""
        if not self._placement.publish_due():
            return
        for peer in self._peers.ready():
            self._notify(peer.address, status, peer.key)

    def take_news(self) -> WorkerNews | None:
        return self._placement.take()

    def layer_ready(self, layer_index: int) -> None:
        """P WRITE: the forward pass has just computed `layer_index` for this step's sends."""
        for t in self._step_sends:
            if not t.state.is_terminal:
                t.layers_ready.add(layer_index)
                self._try_write(t)

    def all_layers_ready(self) -> None:
        for index in range(len(self._layout.layers)):
            self.layer_ready(index)

    # ---- progress --------------------------------------------------------------------------

    def pump(self, wait_s: float = 0.0) -> None:
        """Apply inbox events, completed copies and deadlines. With `wait_s`, block up to that
        long for the first event when transfers are active (saves an idle engine loop's CPU)."""
        if wait_s > 0 and (self._transfers or self._placement.waiting) and self._inbox.empty():
            try:
                self._apply(self._inbox.get(timeout=wait_s))
            except queue.Empty:
                pass
        while True:
            try:
                self._apply(self._inbox.get_nowait())
            except queue.Empty:
                break
        now = time.monotonic()
        if now >= self._next_liveness:
            self._next_liveness = now + LIVENESS_EVERY_S
            self._check_peers()
        for t in list(self._transfers.values()):
            self._check_copies(t)
            if not t.state.is_terminal and now > t.deadline:
                self._expire(t)
        for tid, items in list(self._early.items()):
            kept = [item for item in items if item[0] > now]
            for _, sender, message, _ in (item for item in items if item[0] <= now):
                if isinstance(message, ReadDone):
                    self._ack(sender, message, f"no KV is held for transfer {tid} (unknown or expired)")
            if kept:
                items[:] = kept
            else:
                del self._early[tid]

    def take_finished(self, finished_req_ids: set[str]) -> Finished:
        sending = {t.request_id for t in self._transfers.values() if t.side is Side.SEND}
        self._finished_requests |= finished_req_ids & (sending | self._sent)
        ready = self._sent & self._finished_requests
        self._sent -= ready
        self._finished_requests -= ready
        self._finished.sending |= ready
        out, self._finished = self._finished, Finished()
        return out

    def has_active(self) -> bool:
        return bool(self._transfers)

    @property
    def num_peers(self) -> int:
        return len(self._peers)

    def close(self) -> None:
        self._peers.close()

    # ---- events ----------------------------------------------------------------------------

    def _admit(self, t: Transfer) -> bool:
        if t.transfer_id in self._transfers or t.transfer_id in self._terminal:
            released = t.side is Side.SEND and self._terminal.get(t.transfer_id, 0) is None
            if released:  # D let go before our prefill ended (it prefilled the prompt itself)
                t.fail(f"decode released transfer {t.transfer_id} before its prefill ended")
            else:
                t.fail(f"transfer_id {t.transfer_id!r} is already in use")
            self._finish(t, track=False, quiet=released)
            return False
        self._transfers[t.transfer_id] = t
        for _, sender, message, received in self._early.pop(t.transfer_id, ()):
            if not t.state.is_terminal:
                self._on_transfer_message(t, sender, message, received)
        return True

    def _apply(self, event) -> None:
        if isinstance(event, HandshakeResult):
            peer = self._peers.apply(event)
            if peer is not None:
                self._on_peer(peer)
            return
        sender, message, received = event
        if isinstance(message, PrefillLoad):
            if self._config.role is Role.CONSUMER:
                self._placement.on_load(message)
            return
        if isinstance(message, DecodeStatus):
            if self._config.role is Role.PRODUCER:
                self._placement.on_status(message)
            return
        tid = message.transfer_id
        t = self._transfers.get(tid)
        if t is not None:
            self._on_transfer_message(t, sender, message, received)
        elif self._config.role is Role.PRODUCER and isinstance(message, (RemoteBlocks, Release)):
            self._placement.decided(tid, isinstance(message, RemoteBlocks))
            self._apply_unknown(tid, sender, message, received)
        else:
            self._apply_unknown(tid, sender, message, received)

    def _apply_unknown(self, tid: str, sender: str, message, received: float) -> None:
        """A message for a transfer we do not run (yet, or any more)."""
        if isinstance(message, Release) and self._config.role is Role.PRODUCER and message.reply_host:
            # D gave up on a transfer we have not seen (or already ended): fence it, so a send that
            # comes later never writes, and tell D at once that nothing of ours will touch its blocks.
            if tid not in self._terminal:
                self._remember_terminal(tid)
                self._early.pop(tid, None)
            reply_to = PeerAddress(message.reply_host, 0, message.reply_notify_port)
            self._notify(reply_to, WriteDone(tid, False, f"prefill has no transfer {tid} in progress"), sender)
        elif tid in self._terminal:
            if isinstance(message, ReadDone):
                self._ack(sender, message, f"transfer {tid} is over: its KV was released or expired")
            elif isinstance(message, Release) and self._terminal[tid] is not None:
                # our WriteDone may have been lost: D waits for word that we will not write again
                self._notify(self._terminal[tid], WriteDone(tid, False, f"transfer {tid} is over"), sender)
        else:
            if tid not in self._early and len(self._early) >= MAX_EARLY_IDS:
                self._early.popitem(last=False)
            expiry = time.monotonic() + self._config.defer_timeout
            self._early.setdefault(tid, []).append((expiry, sender, message, received))

    def _on_transfer_message(self, t: Transfer, sender: str, message, received: float) -> None:
        if t.side is Side.RECV and t.peer_identity is None:
            t.deferred.append((sender, message, received))  # applied once we know which incarnation is ours
            return
        if t.peer_identity is not None and sender != t.peer_identity:
            logger.warning("pdserve: ignoring %s for transfer %s from %s: it is bound to %s",
                           type(message).__name__, t.transfer_id, sender, t.peer_identity)
            return
        if t.side is Side.SEND and t.mode is TransferMode.WRITE:
            if isinstance(message, RemoteBlocks):
                self._on_remote_blocks(t, sender, message, received)
            elif isinstance(message, Release):
                t.peer_identity = sender
                self._stop(t, RELEASED_BY_DECODE, tell_peer=True)
        elif t.side is Side.SEND:  # P READ hold: D comes to us
            if isinstance(message, ReadDone):
                self._on_read_done(t, sender, message)
            elif isinstance(message, Release):
                t.fail("decode released the held KV without reading it")
                self._finish(t)
        elif t.mode is TransferMode.WRITE and isinstance(message, WriteDone):
            self._on_write_done(t, message)
        elif t.mode is TransferMode.READ and isinstance(message, ReadAck):
            self._on_read_ack(t, message)
        else:
            logger.warning("pdserve: ignoring %s for %s transfer %s", type(message).__name__, t.side.value, t.transfer_id)

    def _on_remote_blocks(self, t: Transfer, sender: str, message: RemoteBlocks, received: float) -> None:
        if t.remote_block_ids is not None or t.stopping:
            return  # a duplicate, or too late
        t.peer_identity = sender
        if message.prompt_hash != t.prompt_hash:
            self._stop(t, "decode announced blocks for a different prompt (prompt digests differ)", tell_peer=True)
            return
        if len(message.block_ids) != len(t.local_block_ids):
            self._stop(t, f"block counts differ: prefill has {len(t.local_block_ids)}, decode announced "
                          f"{len(message.block_ids)}", tell_peer=True)
            return
        t.remote_block_ids, t.first_block = tuple(message.block_ids), message.first_block
        window = min(message.write_for, self._config.defer_timeout)
        t.not_after = received + window - min(WRITE_MARGIN_S, window / 10)
        if t.not_after <= time.monotonic():
            self._stop(t, "decode's write deadline passed before its blocks could be written", tell_peer=True)
            return
        self._try_write(t)

    def _on_write_done(self, t: Transfer, message: WriteDone) -> None:
        if message.ok and not t.announced:
            t.fail("prefill confirmed a write of blocks decode never announced")
        elif message.ok and not t.stopping and message.prompt_hash == t.prompt_hash:
            t.num_bytes = (len(t.local_block_ids) - t.first_block) * sum(l.block_bytes for l in self._layout.layers)
            t.succeed()
        elif message.ok and not t.stopping:
            t.fail("prefill delivered the KV of a different prompt (prompt digests differ)")
        else:  # P stopped for good: no copy of it can touch our blocks any more
            t.fail(t.error or f"prefill could not deliver the KV: {message.error}")
        self._finish(t)

    def _on_read_done(self, t: Transfer, sender: str, message: ReadDone) -> None:
        if message.prompt_hash != t.prompt_hash:
            self._ack(sender, message, f"transfer {t.transfer_id} holds the KV of a different prompt")
        elif tuple(message.block_ids) != t.local_block_ids:
            self._ack(sender, message, f"transfer {t.transfer_id} holds blocks {list(t.local_block_ids)}, "
                                       f"not {list(message.block_ids)}")
        else:
            t.succeed()
            self._ack(sender, message, "")
            self._finish(t)

    def _on_read_ack(self, t: Transfer, message: ReadAck) -> None:
        if not t.confirming:
            return
        if message.ok:
            t.succeed()
            self._finish(t)
        else:
            self._fail(t, f"prefill did not confirm the KV it held: {message.error}")

    def _on_peer(self, peer: Peer) -> None:
        for message in peer.outbox:  # what waited for this handshake
            if peer.state is PeerState.READY:
                self._notify(peer.address, message, peer.key)
            elif peer.refused_by and isinstance(message, LETTING_GO):
                self._notify(peer.address, message, peer.refused_by)
        peer.outbox.clear()
        for t in list(self._transfers.values()):
            if t.peer != peer.address or t.state.is_terminal:
                continue
            if t.side is Side.RECV:
                self._bind(t)
            elif peer.refused_by:
                self._fail(t, peer.error)  # incompatible: D will never take our KV, so free it now
            else:
                self._try_write(t)

    # ---- peers -----------------------------------------------------------------------------

    def _bound_peer(self, t: Transfer) -> Peer | None:
        """The ready peer of `t`'s incarnation, or None (waiting for a handshake, or failed)."""
        peer = self._peers.lookup(t.peer)
        if peer.state is PeerState.FAILED:
            if not self._allow.allows(t.peer.host):
                self.stats.num_refused += 1
            self._fail(t, peer.error)
            return None
        if peer.state is not PeerState.READY or peer.refreshing:
            return None
        if peer.incarnation.is_gone():
            self._peer_gone(peer.address, peer.key)
            if not t.state.is_terminal:
                self._peers.lookup(t.peer)  # handshake whoever listens there now; _on_peer resumes t
            return None
        if t.peer_identity is None or t.peer_identity == peer.key:
            return peer
        if not t.refreshed:  # our view may be stale: the peer at that address may have restarted
            t.refreshed = True
            self._peers.refresh(t.peer)
            return None
        self.stats.num_fenced += 1
        self._stop(t, f"peer incarnation {t.peer_identity} is gone ({peer.key} listens there now)", tell_peer=False)
        return None

    def _bind(self, t: Transfer) -> None:
        """D: bind to the peer's current incarnation, then announce (WRITE) or read (READ)."""
        if t.peer_identity is not None:
            if t.mode is TransferMode.READ:
                self._try_read(t)
            return
        peer = self._bound_peer(t)
        if peer is None:
            return
        t.peer_identity = peer.key
        t.peer_incarnation = peer.incarnation
        deferred, t.deferred = t.deferred, []
        for sender, message, received in deferred:  # e.g. P's WriteDone(ok=False): then nothing is announced
            if not t.state.is_terminal:
                self._on_transfer_message(t, sender, message, received)
        if t.state.is_terminal or t.stopping:
            return
        if t.mode is TransferMode.WRITE:
            t.announced_at = time.monotonic()  # before it is queued: the fence counts from here
            t.write_for = max(0.0, t.deadline - t.announced_at)
            t.announced = self._notify(
                t.peer, RemoteBlocks(t.transfer_id, list(t.local_block_ids), t.first_block, t.prompt_hash, t.write_for),
                peer.key)
            if not t.announced:
                self._fail(t, f"cannot reach the prefill instance at {t.peer.host}:{t.peer.notify_port}")
        else:
            self._try_read(t)

    def _send(self, address: PeerAddress | None, message) -> None:
        """Send to the current incarnation at `address` (after a handshake, if none yet)."""
        if address is None:
            return
        peer = self._peers.lookup(address)
        if peer.state is PeerState.READY:
            self._notify(address, message, peer.key)
        elif peer.state is PeerState.CONNECTING:
            peer.outbox.append(message)
        elif peer.refused_by and isinstance(message, LETTING_GO):
            self._notify(address, message, peer.refused_by)  # incompatible, yet it can let go of its blocks

    def _notify(self, address: PeerAddress, message, recipient: str) -> bool:
        """Every message leaves through here: only to allowed hosts, always to one incarnation."""
        if not self._allow.allows(address.host):
            logger.error("pdserve: not sending %s: %s", type(message).__name__, self._allow.refusal(address.host))
            return False
        return self._notifier.notify(address, message, recipient)

    def _release(self, transfer_id: str) -> Release:
        return Release(transfer_id, self._config.host_ip, self._config.notify_port)

    def _ack(self, sender: str, message: ReadDone, error: str) -> None:
        reply_to = PeerAddress(message.reply_host, 0, message.reply_notify_port)
        self._notify(reply_to, ReadAck(message.transfer_id, not error, error), sender)

    def _check_peers(self) -> None:
        for peer in self._peers.gone():
            self._peer_gone(peer.address, peer.key, already_removed=True)
        busy = {t.peer for t in self._transfers.values() if t.peer is not None}
        for peer in self._peers.evict_idle(busy):
            self._notifier.forget(peer.address)

    def _peer_gone(self, address: PeerAddress, identity: str, already_removed: bool = False) -> None:
        """Incarnation `identity` died: nothing of it can copy any more; fail what was bound to it."""
        if not already_removed:
            self._peers.drop(address)
        self._notifier.forget(address)
        for t in list(self._transfers.values()):
            if t.peer_identity == identity and not t.state.is_terminal:
                self.stats.num_fenced += 1
                t.fence_deadline = time.monotonic()  # a dead process writes nothing
                self._stop(t, f"peer incarnation {identity} died", tell_peer=False)

    # ---- copies ----------------------------------------------------------------------------

    def _try_write(self, t: Transfer) -> None:
        if t.state.is_terminal or t.stopping or t.remote_block_ids is None:
            return
        layers = t.layers_ready - t.layers_submitted
        if not layers:
            return
        peer = self._bound_peer(t)
        if peer is not None:
            self._submit(t, peer, Direction.WRITE, layers)
            t.layers_submitted |= layers

    def _try_read(self, t: Transfer) -> None:
        if t.state is not TransferState.WAITING or t.handles:
            return
        peer = self._bound_peer(t)
        if peer is not None:
            self._submit(t, peer, Direction.READ, range(len(self._layout.layers)))

    def _submit(self, t: Transfer, peer: Peer, direction: Direction, layers) -> None:
        try:
            batch = self._layout.layer_ops(peer.layout, layers, t.block_pairs())
        except PDServeError as exc:
            self._stop(t, str(exc), tell_peer=True)
            return
        t.start_copying()
        handle = self._transport.submit(peer.key, direction, batch, not_after=t.not_after)
        t.handles.append(handle)
        t.num_bytes += handle.num_bytes

    def _check_copies(self, t: Transfer) -> None:
        if t.state.is_terminal or (t.side is Side.SEND and t.mode is TransferMode.READ):
            return
        if t.pending_handles:
            return
        if t.stopping:
            self._conclude_stop(t)
            return
        failed = [h.error for h in t.handles if h.status is TransferStatus.FAILED]
        if failed:
            self._stop(t, f"copy failed: {failed[0]}", tell_peer=True)
        elif t.side is Side.SEND:
            if t.remote_block_ids is not None and len(t.layers_submitted) == len(self._layout.layers):
                t.succeed()
                self._notify(t.peer, WriteDone(t.transfer_id, True, "", t.prompt_hash), t.peer_identity)
                self._finish(t)
        elif t.mode is TransferMode.READ and t.handles and not t.confirming:
            t.confirming = True
            self._notify(t.peer, ReadDone(t.transfer_id, list(t.remote_block_ids or ()), t.prompt_hash,
                                                   self._config.host_ip, self._config.notify_port), t.peer_identity)

    # ---- endings ---------------------------------------------------------------------------

    def _expire(self, t: Transfer) -> None:
        if t.side is Side.RECV and t.mode is TransferMode.WRITE and t.announced and not t.stopping:
            self._stop(t, f"timed out after {self._config.transfer_timeout:.1f} s waiting for the prefill's KV",
                       tell_peer=True)
            return
        if t.stopping:
            self._conclude_stop(t)
            return
        if t.side is Side.SEND and t.mode is TransferMode.READ:
            reason = "decode never released the held KV blocks"
        elif t.side is Side.SEND and t.remote_block_ids is None:
            reason = "decode never announced its blocks"
        elif t.side is Side.RECV and t.peer_identity is None:
            reason = "could not reach the prefill instance in time"
        else:
            reason = f"timed out in state {t.state.value}"
        self._stop(t, reason, tell_peer=True)

    def _stop(self, t: Transfer, reason: str, tell_peer: bool) -> None:
        """Wind `t` down: no new copies, queued ones cancelled; it fails once nothing can touch
        its blocks any more (see `_conclude_stop`)."""
        if t.state.is_terminal:
            return
        first = not t.stopping
        t.stopping = t.stopping or reason
        if first:
            t.error = reason
            for handle in t.pending_handles:
                self._transport.cancel(handle)
            if t.side is Side.RECV and t.mode is TransferMode.WRITE and t.announced and t.fence_deadline is None:
                t.fence_deadline = t.announced_at + t.write_for + self._config.release_grace
                t.deadline = max(t.deadline, t.fence_deadline)
            if tell_peer and t.peer is not None:
                self._tell_stopped(t, reason)
        self._conclude_stop(t)

    def _tell_stopped(self, t: Transfer, reason: str) -> None:
        if t.side is Side.SEND and t.mode is TransferMode.WRITE:
            return  # WriteDone(False) goes out in _conclude_stop, once no copy of ours is running
        message = self._release(t.transfer_id)
        if t.peer_identity is not None:
            self._notify(t.peer, message, t.peer_identity)
        elif t.side is Side.RECV:
            self._send(t.peer, message)  # not bound yet: P holds (READ) or waits to write (WRITE) for us

    def _conclude_stop(self, t: Transfer) -> None:
        if t.state.is_terminal or t.pending_handles:
            return  # never free memory a copy is still touching; copies are bounded
        if t.side is Side.RECV and t.mode is TransferMode.WRITE and t.announced:
            if t.fence_deadline is not None and time.monotonic() < t.fence_deadline:
                return  # P may still be copying into our blocks: wait for WriteDone or the fence
            if self._may_still_copy(t):
                return
        if t.side is Side.SEND and t.mode is TransferMode.WRITE:
            done = WriteDone(t.transfer_id, False, t.stopping)
            if t.peer_identity is not None:
                self._notify(t.peer, done, t.peer_identity)
            else:
                self._send(t.peer, done)
        t.fail(t.stopping or t.error)
        self._finish(t)

    def _may_still_copy(self, t: Transfer) -> bool:
        """Past the fence a P elsewhere cannot be observed from here, so for it the fence alone
        decides: its transport let no byte land after the window (module docstring). A P on this
        host that provably lives may instead be frozen mid-copy (stopped, or never scheduled) and
        land a chunk whenever it resumes, so D keeps waiting for its WriteDone (asking again with
        a Release every release_grace, in case the answer was lost) until that P has run on the
        CPU since the fence and one more transfer_timeout has passed: a running P's copy thread
        checks the deadline before every chunk and stops."""
        incarnation = t.peer_incarnation
        if incarnation is None or not incarnation.same_host or incarnation.is_gone():
            return False
        now = time.monotonic()
        cpu = incarnation.cpu_ticks()
        if t.peer_cpu_at_fence is None:
            t.peer_cpu_at_fence = cpu
        ran = cpu is not None and t.peer_cpu_at_fence is not None and cpu > t.peer_cpu_at_fence
        if ran and now >= (t.fence_deadline or 0.0) + self._config.transfer_timeout:
            logger.error("pdserve: prefill %s never confirmed it stopped writing transfer %s, though it ran since "
                         "its deadline; reusing its blocks", t.peer_identity, t.transfer_id)
            return False
        if now >= t.next_release:
            t.next_release = now + self._config.release_grace
            self._notify(t.peer, self._release(t.transfer_id), t.peer_identity)
        return True

    def _fail(self, t: Transfer, reason: str) -> None:
        self._stop(t, reason, tell_peer=True)

    def _finish(self, t: Transfer, track: bool = True, quiet: bool = False) -> None:
        if track:
            self._transfers.pop(t.transfer_id, None)
            self._remember_terminal(t.transfer_id, t.peer if t.side is Side.SEND else None)
        self.stats.copy_seconds += sum(h.copy_seconds or 0.0 for h in t.handles)
        self.stats.copy_bytes += sum(h.num_bytes for h in t.handles if h.status is TransferStatus.DONE)
        if t.state is TransferState.DONE:
            self.stats.num_completed += 1
            self.stats.num_bytes += t.num_bytes
            self.stats.seconds.append(t.seconds)
            self.stats.transfer_bytes.append(t.num_bytes)
        else:
            self.stats.num_failed += 1
            log = logger.info if quiet or t.error == RELEASED_BY_DECODE else logger.error
            log("pdserve: transfer %s (request %s) failed: %s [%s]", t.transfer_id, t.request_id,
                t.error, t.describe())
        if t.side is Side.SEND:
            self._sent.add(t.request_id)
        else:
            self._finished.recving.add(t.request_id)
            if t.state is TransferState.FAILED:
                self._finished.failed_recving.add(t.request_id)

    def _remember_terminal(self, tid: str, peer: PeerAddress | None = None) -> None:
        self._terminal[tid] = peer
        self._terminal.move_to_end(tid)
        while len(self._terminal) > MAX_TERMINAL_IDS:
            self._terminal.popitem(last=False)
