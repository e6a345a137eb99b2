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
  stopped, P's incarnation provably died, or P's write window has provably closed.

The write window and its fence (WRITE mode) are in transfers/write_recv.py; the per-leg
behaviour of each kind of leg is in transfers/ (one unit per kind), the engine dispatching to it.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import time
from collections import OrderedDict
from typing import Callable

from pdserve.config import ConnectorConfig, TransferMode
from pdserve.connector.allowlist import PeerAllowList
from pdserve.connector.layout import KvLayout
from pdserve.connector.metadata import AwaitSpec, CancelSpec, HoldSpec, RecvSpec, SendSpec
from pdserve.connector.peers import HandshakeResult, Peer, PeerTable
from pdserve.connector.ranks import SINGLE, Ranks, Slicing
from pdserve.connector.transfer import Side, Transfer, TransferState
from pdserve.connector.transfers import leg_kinds
from pdserve.connector.transfers.base import LegKind
from pdserve.connector.transfers.binding import PeerBinding
from pdserve.connector.transfers.completions import Completions, Finished, TransferStats
from pdserve.connector.transfers.fanout import Fanout
from pdserve.connector.transfers.messenger import Messenger, Notifier
from pdserve.connector.transfers.placement_link import PLACEMENT_MESSAGES, PlacementLink
from pdserve.connector.transfers.records import TransferRecords
from pdserve.connector.transfers.verify import Verifier
from pdserve.connector.transfers.write_send import RELEASED_BY_DECODE
from pdserve.control.address import PeerAddress
from pdserve.errors import PDServeError
from pdserve.transport.base import Direction, TransferStatus, Transport
from pdserve.transport.staged import StagedTransport

__all__ = ["Finished", "Notifier", "TransferEngine", "TransferStats"]

logger = logging.getLogger("pdserve.connector")

LIVENESS_EVERY_S = 0.5
MAX_STAGED = 4096  # P READ, host staging: holds remembered as staged; one forgotten is refused (fails closed)


class TransferEngine:
    def __init__(self, config: ConnectorConfig, layout: KvLayout, transport: Transport,
                 notifier: Notifier, handshake: Callable[[PeerAddress], HandshakeResult], ranks: Ranks = SINGLE):
        self.config = config
        self._layout = layout
        self._transport = transport
        # KV on a GPU staged in host memory: P stages held blocks, D lands written ones (staged.py)
        self.staging = transport if isinstance(transport, StagedTransport) else None
        self.staged: OrderedDict[str, None] = OrderedDict()  # P READ: holds whose KV reached the mirror, until they end
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        allow = PeerAllowList(config.allowed_peers)
        self._peers = PeerTable(transport, handshake, self._inbox.put, allow, config.peer_idle_timeout)
        self.messenger = Messenger(config, notifier, allow, self._peers)
        self.binding = PeerBinding(self, self._peers, allow)
        self._transfers: dict[str, Transfer] = {}
        self._records = TransferRecords(config, self.messenger)
        self._kinds = leg_kinds(self)
        self._step_sends: list[Transfer] = []
        self._step = 0  # counts engine steps
        self._step_layers: set[int] = set()  # layers the current step computed so far
        self.fanout = Fanout(self, ranks, self._peers)
        self._completions = Completions()
        self._next_liveness = 0.0
        self.placement = PlacementLink(config, self.messenger, self._peers, self._records)
        self.stats = TransferStats()
        self.verifier = Verifier(self, config.kv_verify == "digest")

    # ---- inputs ----------------------------------------------------------------------------

    def on_message(self, sender: str, message) -> None:
        """Thread-safe: called by control-plane server threads with an authenticated message."""
        self._inbox.put((sender, message, time.monotonic()))

    def begin_step(self) -> None:
        self._step_sends = []
        self._step += 1
        self._step_layers = set()

    def add_send(self, spec: SendSpec) -> None:
        self.fanout.add(spec, self._step)  # opens a send per rank pair (open_send)

    def open_send(self, spec: SendSpec, tid: str, peer: PeerAddress, slicing: Slicing | None, group: str,
                  step: int, arrived: float) -> None:
        t = Transfer(tid, spec.request_id, Side.SEND, TransferMode.WRITE, peer, spec.block_ids,
                     arrived + self.config.defer_timeout, prompt_hash=spec.prompt_hash, slicing=slicing,
                     group=group)
        this_step = step == self._step
        t.copies.layers_ready |= self._step_layers if this_step else set(range(self.num_layers))
        if self._admit(t) and not t.state.is_terminal:
            if this_step:
                self._step_sends.append(t)
            self.binding.prepare(t)
            self._kinds[(Side.SEND, TransferMode.WRITE)].try_write(t)

    def add_hold(self, spec: HoldSpec) -> None:
        deadline = time.monotonic() + max(0.0, spec.expires_at - time.time())
        t = Transfer(spec.transfer_id, spec.request_id, Side.SEND, TransferMode.READ, None, spec.block_ids, deadline,
                     prompt_hash=spec.prompt_hash)
        if self._admit(t):
            # a D rank named its sub-transfer already (read it, or let go of it)
            for name in self._records.early_subs(spec.transfer_id) + self._records.fenced_subs(spec.transfer_id):
                self.fanout.split_hold(name)

    def replace_hold(self, parent: Transfer, subs: list[tuple[str, Slicing | None]]) -> None:
        """P READ: hold `parent`'s blocks as one sub-transfer per D rank that reads (or releases)
        them, each with the heads that rank reads."""
        del self._transfers[parent.transfer_id]
        for tid, slicing in subs:
            self._admit(Transfer(tid, parent.request_id, Side.SEND, TransferMode.READ, None, parent.local_block_ids,
                                 parent.deadline, prompt_hash=parent.prompt_hash, slicing=slicing,
                                 group=parent.transfer_id, created_at=parent.created_at))

    def add_recv(self, spec: RecvSpec) -> None:
        if spec.error:
            self.reject(spec, spec.error)
        else:
            self.fanout.add(spec, self._step)  # opens a receive per rank pair (open_recv)

    def reject(self, spec: SendSpec | RecvSpec, reason: str) -> None:
        """Fail `spec`'s request at once, touching no transfer of that id."""
        recv = isinstance(spec, RecvSpec)
        t = Transfer(spec.transfer_id, spec.request_id, Side.RECV if recv else Side.SEND,
                     spec.mode if recv else TransferMode.WRITE, spec.peer, spec.block_ids, time.monotonic())
        t.fail(reason)
        self.finish(t, track=False)

    def open_recv(self, spec: RecvSpec, tid: str, peer: PeerAddress, slicing: Slicing | None, group: str,
                  arrived: float) -> None:
        t = Transfer(tid, spec.request_id, Side.RECV, spec.mode, peer, spec.block_ids,
                     arrived + self.config.transfer_timeout, spec.remote_block_ids, spec.first_block,
                     prompt_hash=spec.prompt_hash, slicing=slicing, group=group)
        if self._admit(t) and not t.state.is_terminal:
            self.binding.bind(t)

    def cancel(self, spec: CancelSpec) -> None:
        """The scheduler decided this transfer will not happen (or must stop: a preempted
        prefill's blocks are already freed): stop it and tell the peer to let go."""
        t = self._transfers.get(spec.transfer_id)
        if t is not None:
            self.stop(t, spec.reason, tell_peer=True)
            return
        if not self.fanout.cancel(spec) and self._records.fence(spec):
            self.fanout.tell_every_rank(spec.peer, self._records.letting_go(spec))

    def await_decision(self, spec: AwaitSpec) -> None:
        """P, adaptive placement: the prefill leg of `spec` waits for D's word (placement_link.py)."""
        self.placement.await_decision(spec, running=spec.transfer_id in self._transfers)

    def layer_ready(self, layer_index: int) -> None:
        """P WRITE: the forward pass has just computed `layer_index` for this step's sends."""
        self._step_layers.add(layer_index)
        for t in self._step_sends:
            if not t.state.is_terminal:
                t.copies.layers_ready.add(layer_index)
                self._kinds[(Side.SEND, TransferMode.WRITE)].try_write(t)

    def all_layers_ready(self) -> None:
        for index in range(self.num_layers):
            self.layer_ready(index)

    # ---- progress --------------------------------------------------------------------------

    def pump(self, wait_s: float = 0.0) -> None:
        """Apply inbox events, completed copies and deadlines. With `wait_s`, block up to that
        long for the first event when transfers are active (saves an idle engine loop's CPU)."""
        if wait_s > 0 and (self._transfers or self.placement.waiting) and self._inbox.empty():
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
            self.binding.check_peers()
        for t in list(self._transfers.values()):
            self._check_copies(t)
            if not t.state.is_terminal and now > t.deadline:
                self._expire(t)
        self._records.expire_early(now)
        self.fanout.expire(now)

    def take_finished(self, finished_req_ids: set[str]) -> Finished:
        sending = {t.request_id for t in self._transfers.values() if t.side is Side.SEND} | self.fanout.parked_sends()
        return self._completions.take(finished_req_ids, sending)

    def transfer(self, transfer_id: str) -> Transfer | None:
        return self._transfers.get(transfer_id)

    def running(self) -> list[Transfer]:
        """The transfers not yet DONE or FAILED (a copy: callers may end some)."""
        return list(self._transfers.values())

    def has_active(self) -> bool:
        return bool(self._transfers)

    @property
    def num_peers(self) -> int:
        return len(self._peers)

    @property
    def layout(self) -> KvLayout:
        return self._layout

    @property
    def transport(self) -> Transport:
        return self._transport

    @property
    def num_layers(self) -> int:
        return len(self._layout.layers)

    def bytes_to_move(self, t: Transfer) -> int:
        """Bytes `t`'s copies move, over every layer (only its heads, only blocks in the window)."""
        if t.remote_block_ids is None:  # D WRITE: P's blocks are P's business; D's decide what lands
            t = dataclasses.replace(t, remote_block_ids=t.local_block_ids)
        return self._layout.bytes_moved(t.group_pairs(self._layout.group_sparse), t.slicing)

    def close(self) -> None:
        self._peers.close()

    # ---- events ----------------------------------------------------------------------------

    def kind(self, t: Transfer) -> LegKind:
        """The unit that runs `t`'s kind of leg (transfers/)."""
        return self._kinds[(t.side, t.mode)]

    def _admit(self, t: Transfer) -> bool:
        terminal = self._records.terminal
        if t.transfer_id in self._transfers or t.transfer_id in terminal:
            released = t.side is Side.SEND and terminal.get(t.transfer_id, 0) is None
            if released:  # D let go before our prefill ended (it prefilled the prompt itself)
                t.fail(f"decode released transfer {t.transfer_id} before its prefill ended")
            else:
                t.fail(f"transfer_id {t.transfer_id!r} is already in use")
            self.finish(t, track=False, quiet=released)
            return False
        self._transfers[t.transfer_id] = t
        for early in self._records.take_early(t.transfer_id):
            if not t.state.is_terminal:
                self.deliver(t, early.sender, early.message, early.received)
        return True

    def _apply(self, event) -> None:
        if isinstance(event, HandshakeResult):
            peer = self._peers.apply(event)
            if peer is not None:
                self.binding.on_peer(peer)
                self.fanout.on_peer(peer)
            return
        sender, message, received = event
        if isinstance(message, PLACEMENT_MESSAGES):
            self.placement.on_message(message)
            return
        tid = message.transfer_id
        t = self._transfers.get(tid) or self.fanout.split_hold(tid)
        if t is not None:
            self.deliver(t, sender, message, received)
            return
        if self.fanout.let_go_of_group(tid, message):
            return
        self.placement.on_unknown(tid, message)
        self._records.on_message(tid, sender, message, received)

    def deliver(self, t: Transfer, sender: str, message, received: float) -> None:
        """Hand a peer's message to `t`'s kind, only from the incarnation `t` is bound to."""
        if t.side is Side.RECV and t.link.identity is None:
            t.link.deferred.append((sender, message, received))  # applied once we know which incarnation is ours
            return
        if t.link.identity is not None and sender != t.link.identity:
            logger.warning("pdserve: ignoring %s for transfer %s from %s: it is bound to %s",
                           type(message).__name__, t.transfer_id, sender, t.link.identity)
            return
        self.kind(t).on_message(t, sender, message, received)

    # ---- copies ----------------------------------------------------------------------------

    def submit(self, t: Transfer, peer: Peer, direction: Direction, layers) -> None:
        """Start copying `layers` of `t`'s block pairs with `peer`, bounded by `t.copies.not_after`."""
        try:
            batch = self._layout.layer_ops(peer.layout, layers, t.group_pairs(self._layout.group_sparse), t.slicing)
        except PDServeError as exc:
            self.stop(t, str(exc), tell_peer=True)
            return
        if direction is Direction.WRITE:
            self.verifier.hash_sent(t, layers)
        t.start_copying()
        handle = self._transport.submit(peer.key, direction, batch, not_after=t.copies.not_after)
        t.copies.handles.append(handle)
        t.copies.num_bytes += handle.num_bytes

    def land(self, t: Transfer) -> None:
        """D WRITE, host staging: copy the blocks P wrote into our mirror on to the device (from
        `first_block` on, as P wrote them), bounded by `t`'s deadline."""
        try:
            pairs = dataclasses.replace(t, remote_block_ids=t.local_block_ids).group_pairs(self._layout.group_sparse)
            batch = self._layout.layer_ops(self._layout, range(self.num_layers), pairs)
        except PDServeError as exc:
            self.stop(t, str(exc), tell_peer=True)
            return
        t.copies.handles.append(self.staging.land(batch, not_after=t.deadline))

    def stage_succeeded(self, transfer_id: str) -> None:
        """P READ, host staging: the held KV of `transfer_id` reached the mirror. Only such a hold
        answers D's read with ok (read_hold.py); the mark goes when the hold ends, or the oldest
        beyond MAX_STAGED goes (its read is then refused: D recomputes)."""
        self.staged[transfer_id] = None
        self.staged.move_to_end(transfer_id)
        while len(self.staged) > MAX_STAGED:
            self.staged.popitem(last=False)

    def stage_failed(self, transfer_id: str) -> None:
        """P READ, host staging: the held KV of `transfer_id` may not be in the mirror (staging it
        again after a preemption failed, say): D's read of it is refused."""
        self.staged.pop(transfer_id, None)

    def _check_copies(self, t: Transfer) -> None:
        if t.state.is_terminal or t.copies.pending:
            return
        if t.stopping:
            self._conclude_stop(t)
            return
        failed = [h.error for h in t.copies.handles if h.status is TransferStatus.FAILED]
        if failed:
            self.stop(t, f"copy failed: {failed[0]}", tell_peer=True)
        else:
            self.kind(t).copies_settled(t)

    # ---- endings ---------------------------------------------------------------------------

    def _expire(self, t: Transfer) -> None:
        if t.stopping:
            self._conclude_stop(t)
        else:
            self.stop(t, self.kind(t).expiry_reason(t), tell_peer=True)

    def stop(self, t: Transfer, reason: str, tell_peer: bool) -> None:
        """Wind `t` down: no new copies, queued ones cancelled; it fails once nothing can touch
        its blocks any more (see `_conclude_stop`)."""
        if t.state.is_terminal:
            return
        if t.stop(reason):
            for handle in t.copies.pending:
                self._transport.cancel(handle)
            self.kind(t).on_stopping(t)
            if tell_peer and t.peer is not None:
                self.kind(t).tell_stopped(t)
        self._conclude_stop(t)

    def _conclude_stop(self, t: Transfer) -> None:
        if t.state.is_terminal or t.copies.pending:
            return  # never free memory a copy is still touching; copies are bounded
        kind = self.kind(t)
        if kind.may_fail(t):
            kind.before_fail(t)
            t.fail(t.error)
            self.finish(t)

    def finish(self, t: Transfer, track: bool = True, quiet: bool = False) -> None:
        """`t` reached DONE or FAILED: account for it and report its request."""
        if track:
            self._transfers.pop(t.transfer_id, None)
            self._records.remember_terminal(t.transfer_id, t.peer if t.side is Side.SEND else None)
            held = t.group or t.transfer_id
            if t.mode is TransferMode.READ and t.side is Side.SEND and held in self.staged and \
                    not any((o.group or o.transfer_id) == held for o in self._transfers.values()):
                del self.staged[held]  # the hold (each D rank's part of it) ended
        self.stats.record(t)
        if t.state is TransferState.FAILED:
            log = logger.info if quiet or t.error == RELEASED_BY_DECODE else logger.error
            log("pdserve: transfer %s (request %s) failed: %s [%s]", t.transfer_id, t.request_id,
                t.error, t.describe())
        if not self.fanout.ended(t):
            self._completions.ended(t)

    def group_ended(self, request_id: str, side: Side, failed: bool) -> None:
        """Every sub-transfer of a request's transfer on this rank ended (transfers/fanout.py)."""
        self._completions.request_ended(request_id, side, failed)
