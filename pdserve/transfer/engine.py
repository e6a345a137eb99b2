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

The write window and its fence (WRITE mode) are in kinds/write_recv.py; what each kind of
transfer does is in kinds/ (one unit per kind), the engine's parts dispatching to it (hooks.py).
The parts are built here, each with the collaborators it uses: `Endings` (stop, finish),
`PeerBinding`, `Copier`, `Fanout` (sub-transfers per rank pair), `Verifier`, `PlacementLink`.
"""

from __future__ import annotations

import logging
import queue
import time
from typing import Callable

from pdserve.config import ConnectorConfig, TransferMode
from pdserve.control.address import PeerAddress
from pdserve.transfer.allowlist import PeerAllowList
from pdserve.transfer.binding import PeerBinding
from pdserve.transfer.completions import Completions, Finished, TransferStats
from pdserve.transfer.copier import Copier
from pdserve.transfer.endings import Endings
from pdserve.transfer.fanout import Fanout, Opening
from pdserve.transfer.groups import Groups
from pdserve.transfer.history import TransferHistory
from pdserve.transfer.hooks import KindTable
from pdserve.transfer.kinds import KindParts, transfer_kinds
from pdserve.transfer.layout import KvLayout
from pdserve.transfer.messenger import Messenger, Notifier
from pdserve.transfer.peers import HandshakeResult, PeerTable
from pdserve.transfer.placement_link import PLACEMENT_MESSAGES, PlacementLink
from pdserve.transfer.ranks import SINGLE, Ranks
from pdserve.transfer.record import Side, Transfer
from pdserve.transfer.specs import AwaitSpec, CancelSpec, HoldSpec, RecvSpec, SendSpec
from pdserve.transfer.staged_holds import StagedHolds
from pdserve.transfer.step_sends import StepSends
from pdserve.transfer.verify import Verifier
from pdserve.transport.base import TransferStatus, Transport
from pdserve.transport.staged import StagedTransport

__all__ = ["Finished", "Notifier", "TransferEngine", "TransferStats"]

logger = logging.getLogger("pdserve.connector")


class TransferEngine:
    def __init__(self, config: ConnectorConfig, layout: KvLayout, transport: Transport,
                 notifier: Notifier, handshake: Callable[[PeerAddress], HandshakeResult], ranks: Ranks = SINGLE):
        # KV on a GPU staged in host memory: P stages held blocks, D lands written ones (staged.py)
        self.staging = transport if isinstance(transport, StagedTransport) else None
        self.staged = StagedHolds()  # P READ: holds whose KV reached the mirror, until they end
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        allow = PeerAllowList(config.allowed_peers)
        self._peers = PeerTable(transport, handshake, self._inbox.put, allow, config.peer_idle_timeout)
        self.messenger = Messenger(config, notifier, allow, self._peers)
        self._transfers: dict[str, Transfer] = {}  # the running ones, shared with the parts below
        self._history = TransferHistory(config, self.messenger)
        self._kinds = KindTable()
        self._completions = Completions()
        self.stats = TransferStats()
        groups = Groups(self._completions)
        self._endings = Endings(transport, self._kinds, self._transfers, self._history, self.stats, self.staged,
                                groups, self._completions)
        self._binding = PeerBinding(self._peers, allow, self.messenger, self.stats, self._endings, self._kinds,
                                   self._transfers)
        verifier = Verifier(layout, transport, self.staging is not None, self.stats, config.kv_verify == "digest")
        copier = Copier(layout, transport, self.staging, verifier, self._endings)
        kinds = transfer_kinds(KindParts(config, self.messenger, self._endings, self._binding, copier, verifier,
                                         self.staged, self.staging is not None, len(layout.layers)))
        self._kinds.register(kinds)
        self._step = StepSends(kinds[(Side.SEND, TransferMode.WRITE)], len(layout.layers))
        self._fanout = Fanout(config, ranks, self._peers, self.messenger, groups, self._transfers, self._endings)
        self.placement = PlacementLink(config, self.messenger, self._peers, self._history)

    # ---- inputs ----------------------------------------------------------------------------

    def on_message(self, sender: str, message) -> None:
        """Thread-safe: called by control-plane server threads with an authenticated message."""
        self._inbox.put((sender, message, time.monotonic()))

    def begin_step(self) -> None:
        self._step.begin()

    def add_send(self, spec: SendSpec) -> None:
        self._split(spec)  # opens a send per rank pair (_open_send)

    def _split(self, spec: SendSpec | RecvSpec) -> None:
        if self._fanout.in_use(spec.transfer_id):
            self.reject(spec, f"transfer_id {spec.transfer_id!r} is already in use")
        else:
            self._open(self._fanout.add(spec, self._step.number))

    def _open(self, openings: list[Opening]) -> None:
        for o in openings:
            if isinstance(o.spec, SendSpec):
                self._open_send(o)
            else:
                self._open_recv(o)

    def _open_send(self, o: Opening) -> None:
        spec = o.spec
        t = Transfer(o.transfer_id, spec.request_id, Side.SEND, TransferMode.WRITE, o.peer, spec.block_ids,
                     o.deadline, prompt_hash=spec.prompt_hash, slicing=o.slicing, group=o.group)
        t.copies.layers_ready |= self._step.layers_ready(o.step)
        if self._admit(t) and not t.state.is_terminal:
            self._step.add(t, o.step)
            self._binding.prepare(t)
            self._step.write(t)

    def add_hold(self, spec: HoldSpec) -> None:
        deadline = time.monotonic() + max(0.0, spec.expires_at - time.time())
        t = Transfer(spec.transfer_id, spec.request_id, Side.SEND, TransferMode.READ, None, spec.block_ids, deadline,
                     prompt_hash=spec.prompt_hash)
        if self._admit(t):
            # a D rank named its sub-transfer already (read it, or let go of it)
            for name in self._history.early_subs(spec.transfer_id) + self._history.fenced_subs(spec.transfer_id):
                self._split_hold(name)

    def _split_hold(self, name: str) -> Transfer | None:
        """P READ: hold a whole prompt's blocks as one sub-transfer per D rank that reads (or
        releases) them, once a D rank named one (`name`, returned if it is ours)."""
        split = self._fanout.split_hold(name)
        if split is None:
            return None
        parent, subs = split
        del self._transfers[parent.transfer_id]
        for tid, slicing in subs:
            self._admit(Transfer(tid, parent.request_id, Side.SEND, TransferMode.READ, None, parent.local_block_ids,
                                 parent.deadline, prompt_hash=parent.prompt_hash, slicing=slicing,
                                 group=parent.transfer_id, created_at=parent.created_at))
        return self._transfers.get(name)

    def add_recv(self, spec: RecvSpec) -> None:
        if spec.error:
            self.reject(spec, spec.error)
        else:
            self._split(spec)  # opens a receive per rank pair (_open_recv)

    def reject(self, spec: SendSpec | RecvSpec, reason: str) -> None:
        """Fail `spec`'s request at once, touching no transfer of that id."""
        recv = isinstance(spec, RecvSpec)
        t = Transfer(spec.transfer_id, spec.request_id, Side.RECV if recv else Side.SEND,
                     spec.mode if recv else TransferMode.WRITE, spec.peer, spec.block_ids, time.monotonic())
        t.fail(reason)
        self._endings.finish(t, track=False)

    def _open_recv(self, o: Opening) -> None:
        spec = o.spec
        t = Transfer(o.transfer_id, spec.request_id, Side.RECV, spec.mode, o.peer, spec.block_ids,
                     o.deadline, spec.remote_block_ids, spec.first_block,
                     prompt_hash=spec.prompt_hash, slicing=o.slicing, group=o.group)
        if self._admit(t) and not t.state.is_terminal:
            self._binding.bind(t)

    def cancel(self, spec: CancelSpec) -> None:
        """The scheduler decided this transfer will not happen (or must stop: a preempted
        prefill's blocks are already freed): stop it and tell the peer to let go."""
        t = self._transfers.get(spec.transfer_id)
        if t is not None:
            self._endings.stop(t, spec.reason, tell_peer=True)
            return
        if not self._fanout.cancel(spec) and self._history.fence(spec):
            self._fanout.tell_every_rank(spec.peer, self._history.letting_go(spec))

    def await_decision(self, spec: AwaitSpec) -> None:
        """P, adaptive placement: the prefill transfer of `spec` waits for D's word (placement_link.py)."""
        self.placement.await_decision(spec, running=spec.transfer_id in self._transfers)

    def layer_ready(self, layer_index: int) -> None:
        """P WRITE: the forward pass has just computed `layer_index` for this step's sends."""
        self._step.layer_ready(layer_index)

    def all_layers_ready(self) -> None:
        for index in range(self._step.num_layers):
            self.layer_ready(index)

    def stage_succeeded(self, transfer_id: str) -> None:
        """P READ, host staging: the held KV of `transfer_id` reached the mirror. Only such a hold
        answers D's read with ok (read_hold.py; staged_holds.py)."""
        self.staged.succeeded(transfer_id)

    def stage_failed(self, transfer_id: str) -> None:
        """P READ, host staging: the held KV of `transfer_id` may not be in the mirror (staging it
        again after a preemption failed, say): D's read of it is refused."""
        self.staged.forget(transfer_id)

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
        self._binding.check_peers(now)
        for t in list(self._transfers.values()):
            self._check_copies(t)
            if not t.state.is_terminal and now > t.deadline:
                self._expire(t)
        self._history.expire_early(now)
        self._open(self._fanout.expire(now))

    def take_finished(self, finished_req_ids: set[str]) -> Finished:
        sending = {t.request_id for t in self._transfers.values() if t.side is Side.SEND} | self._fanout.parked_sends()
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

    def close(self) -> None:
        self._peers.close()

    # ---- events ----------------------------------------------------------------------------

    def _admit(self, t: Transfer) -> bool:
        terminal = self._history.terminal
        if t.transfer_id in self._transfers or t.transfer_id in terminal:
            released = t.side is Side.SEND and terminal.get(t.transfer_id, 0) is None
            if released:  # D let go before our prefill ended (it prefilled the prompt itself)
                t.fail(f"decode released transfer {t.transfer_id} before its prefill ended")
            else:
                t.fail(f"transfer_id {t.transfer_id!r} is already in use")
            self._endings.finish(t, track=False, quiet=released)
            return False
        self._transfers[t.transfer_id] = t
        for early in self._history.take_early(t.transfer_id):
            if not t.state.is_terminal:
                self._kinds.deliver(t, early.sender, early.message, early.received)
        return True

    def _apply(self, event) -> None:
        if isinstance(event, HandshakeResult):
            peer = self._peers.apply(event)
            if peer is not None:
                self._binding.on_peer(peer)
                self._open(self._fanout.on_peer(peer))
            return
        sender, message, received = event
        if isinstance(message, PLACEMENT_MESSAGES):
            self.placement.on_message(message)
            return
        tid = message.transfer_id
        t = self._transfers.get(tid) or self._split_hold(tid)
        if t is not None:
            self._kinds.deliver(t, sender, message, received)
            return
        if self._fanout.let_go_of_group(tid, message):
            return
        self.placement.on_unknown(tid, message)
        self._history.on_message(tid, sender, message, received)

    def _check_copies(self, t: Transfer) -> None:
        if t.state.is_terminal or t.copies.pending:
            return
        if t.stopping:
            self._endings.conclude_stop(t)
            return
        failed = [h.error for h in t.copies.handles if h.status is TransferStatus.FAILED]
        if failed:
            self._endings.stop(t, f"copy failed: {failed[0]}", tell_peer=True)
        else:
            self._kinds.of(t).copies_settled(t)

    def _expire(self, t: Transfer) -> None:
        if t.stopping:
            self._endings.conclude_stop(t)
        else:
            self._endings.stop(t, self._kinds.of(t).expiry_reason(t), tell_peer=True)
