"""TransferEngine: drives every transfer of one worker, free of vLLM.

The worker half feeds it what the scheduler decided (`add_send`, `add_hold`, `add_recv`,
`cancel`), what the forward pass did (`layer_ready`), and what peers said (`on_message`, from
the control-plane threads), then asks `take_finished` which requests are done. Everything but
`on_message` runs on the worker thread, so transfer objects need no locks.

Failure rules enforced here: every transfer has a deadline; a terminal transfer ignores late
messages; a message that arrives before its transfer is known is held (with a deadline) and
applied when the transfer appears; D never reports success unless every byte landed.
"""

from __future__ import annotations

import logging
import queue
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Protocol

from pdserve.config import ConnectorConfig, Role, TransferMode
from pdserve.connector.layout import KvLayout
from pdserve.connector.metadata import CancelSpec, HoldSpec, RecvSpec, SendSpec
from pdserve.connector.peers import HandshakeResult, Peer, PeerState, PeerTable
from pdserve.connector.transfer import Side, Transfer, TransferState
from pdserve.control.address import PeerAddress
from pdserve.connector.holds import HoldBook
from pdserve.control.messages import ReadAck, ReadDone, Release, RemoteBlocks, WriteDone
from pdserve.errors import PDServeError
from pdserve.transport.base import Direction, Transport, TransferStatus

logger = logging.getLogger("pdserve.connector")

MAX_TERMINAL_IDS = 4096
HOLD_MARGIN_S = 0.5  # D refuses a READ result this close to P's hold expiry


class Notifier(Protocol):
    def notify(self, address: PeerAddress, message) -> None:
        """Send a message to the peer's notify port; never blocks for long, never raises."""

    def ask(self, address: PeerAddress, message):
        """Send a request to the peer's handshake port and return its reply; raises PDServeError.
        Called on a background thread."""


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
    seconds: list[float] = field(default_factory=list)  # per transfer: announced/held -> done
    copy_seconds: float = 0.0  # time the transport spent copying (sum over batches)
    copy_bytes: int = 0  # bytes this side's transport copied


class TransferEngine:
    def __init__(self, config: ConnectorConfig, layout: KvLayout, transport: Transport,
                 notifier: Notifier, handshake: Callable[[PeerAddress], HandshakeResult]):
        self._config = config
        self._layout = layout
        self._transport = transport
        self._notifier = notifier
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._peers = PeerTable(transport, handshake, self._inbox.put)
        self._transfers: dict[str, Transfer] = {}
        self._early: dict[str, list[tuple[float, str, object]]] = {}  # transfer_id -> (expiry, sender, msg)
        self._terminal: OrderedDict[str, None] = OrderedDict()
        self._step_sends: list[Transfer] = []
        self._finished_requests: set[str] = set()
        self._sent: set[str] = set()  # request ids whose send side is over, not yet reported
        self._finished = Finished()
        self._holds = HoldBook()
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="pdserve-confirm")
        self.stats = TransferStats()

    # ---- inputs ----------------------------------------------------------------------------

    def on_message(self, sender: str, message) -> None:
        """Thread-safe: called by control-plane server threads."""
        self._inbox.put((sender, message))

    def begin_step(self) -> None:
        self._step_sends = []

    def add_send(self, spec: SendSpec) -> None:
        t = Transfer(spec.transfer_id, spec.request_id, Side.SEND, TransferMode.WRITE, spec.peer,
                     spec.block_ids, time.monotonic() + self._config.defer_timeout)
        if self._admit(t):
            self._step_sends.append(t)
            self._peers.lookup(t.peer)

    def add_hold(self, spec: HoldSpec) -> None:
        deadline = time.monotonic() + max(0.0, spec.expires_at - time.time())
        t = Transfer(spec.transfer_id, spec.request_id, Side.SEND, TransferMode.READ, None, spec.block_ids, deadline)
        self._admit(t)

    def answer_read_done(self, message: ReadDone) -> ReadAck:
        """Thread-safe (control-plane server thread): D finished reading; confirm and release."""
        error = self._holds.take(message.transfer_id, tuple(message.block_ids), wait_s=0.5)
        if not error:
            self._inbox.put(("released", message.transfer_id))
        return ReadAck(message.transfer_id, not error, error)

    def add_recv(self, spec: RecvSpec) -> None:
        t = Transfer(spec.transfer_id, spec.request_id, Side.RECV, spec.mode, spec.peer, spec.block_ids,
                     time.monotonic() + self._config.transfer_timeout, spec.remote_block_ids, spec.first_block)
        if spec.error:
            t.fail(spec.error)
            self._finish(t)
            return
        if not self._admit(t) or t.state.is_terminal:
            return
        if t.mode is TransferMode.WRITE:
            self._notifier.notify(t.peer, RemoteBlocks(t.transfer_id, list(t.local_block_ids), t.first_block))
        else:
            t.hold_expires_at = spec.hold_expires_at
            self._peers.lookup(t.peer)
            self._try_read(t)

    def cancel(self, spec: CancelSpec) -> None:
        """The scheduler decided this transfer will not happen: tell the peer to let go."""
        self._remember_terminal(spec.transfer_id)
        self._early.pop(spec.transfer_id, None)
        if self._config.role is Role.PRODUCER:
            self._notifier.notify(spec.peer, WriteDone(spec.transfer_id, False, spec.reason))
        else:
            self._notifier.notify(spec.peer, Release(spec.transfer_id))

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
        if wait_s > 0 and self._transfers and self._inbox.empty():
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
        for t in list(self._transfers.values()):
            self._check_copies(t)
            if not t.state.is_terminal and now > t.deadline:
                self._expire(t)
        for tid, items in list(self._early.items()):
            items[:] = [item for item in items if item[0] > now]
            if not items:
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

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._peers.close()

    # ---- internals -------------------------------------------------------------------------

    def _admit(self, t: Transfer) -> bool:
        if t.transfer_id in self._transfers or t.transfer_id in self._terminal:
            t.fail(f"transfer_id {t.transfer_id!r} is already in use")
            self._finish(t, track=False)
            return False
        self._transfers[t.transfer_id] = t
        if t.side is Side.SEND and t.mode is TransferMode.READ:
            self._holds.add(t.transfer_id, t.local_block_ids)  # before early messages: a Release drops it
        for _, sender, message in self._early.pop(t.transfer_id, ()):
            self._on_transfer_message(t, sender, message)
        return True

    def _apply(self, event) -> None:
        if isinstance(event, HandshakeResult):
            peer = self._peers.apply(event)
            if peer is not None:
                self._on_peer(peer)
            return
        if event[0] == "released":  # P READ: D confirmed its read (answer_read_done)
            t = self._transfers.get(event[1])
            if t is not None and not t.state.is_terminal:
                t.succeed()
                self._finish(t)
            return
        if event[0] == "read_ack":  # D READ: P's answer to our ReadDone
            self._on_read_ack(event[1], event[2])
            return
        sender, message = event
        tid = getattr(message, "transfer_id", None)
        if tid is None or tid in self._terminal:
            return
        t = self._transfers.get(tid)
        if t is None:
            expiry = time.monotonic() + self._config.defer_timeout
            self._early.setdefault(tid, []).append((expiry, sender, message))
            return
        self._on_transfer_message(t, sender, message)

    def _on_transfer_message(self, t: Transfer, sender: str, message) -> None:
        if isinstance(message, RemoteBlocks) and t.side is Side.SEND and t.mode is TransferMode.WRITE:
            t.remote_block_ids, t.first_block = tuple(message.block_ids), message.first_block
            self._peers.lookup(t.peer, identity=sender)
            self._try_write(t)
        elif isinstance(message, Release) and t.side is Side.SEND:
            if t.mode is TransferMode.READ:  # D gave up before reading
                self._holds.discard(t.transfer_id)
                t.fail("decode released the held KV without reading it")
                self._finish(t)
            else:
                t.release_requested = True
                self._check_copies(t)
        elif isinstance(message, WriteDone) and t.side is Side.RECV and t.mode is TransferMode.WRITE:
            if t.release_requested:
                t.fail(t.error or "timed out waiting for the prefill's KV")
            elif message.ok:
                t.num_bytes = (len(t.local_block_ids) - t.first_block) * sum(l.block_bytes for l in self._layout.layers)
                t.succeed()
            else:
                t.fail(f"prefill could not deliver the KV: {message.error}")
            self._finish(t)
        else:
            logger.warning("pdserve: ignoring %s for %s transfer %s", type(message).__name__, t.side.value, t.transfer_id)

    def _on_peer(self, peer: Peer) -> None:
        for t in list(self._transfers.values()):
            if t.peer != peer.address or t.state.is_terminal:
                continue
            if t.side is Side.SEND:
                self._try_write(t)
            elif t.mode is TransferMode.READ:
                self._try_read(t)

    def _ready_peer(self, t: Transfer) -> Peer | None:
        peer = self._peers.lookup(t.peer)
        if peer.state is PeerState.FAILED:
            self._fail(t, peer.error)
            return None
        return peer if peer.state is PeerState.READY else None

    def _try_write(self, t: Transfer) -> None:
        if t.state.is_terminal or t.release_requested or t.remote_block_ids is None:
            return
        peer = self._ready_peer(t)
        layers = t.layers_ready - t.layers_submitted
        if peer is None or not layers:
            return
        self._submit(t, peer, Direction.WRITE, layers)
        t.layers_submitted |= layers

    def _try_read(self, t: Transfer) -> None:
        if t.state is not TransferState.WAITING:
            return
        peer = self._ready_peer(t)
        if peer is not None:
            self._submit(t, peer, Direction.READ, range(len(self._layout.layers)))

    def _submit(self, t: Transfer, peer: Peer, direction: Direction, layers) -> None:
        try:
            batch = self._layout.layer_ops(peer.layout, layers, t.block_pairs())
        except PDServeError as exc:
            self._fail(t, str(exc))
            return
        t.start_copying()
        handle = self._transport.submit(peer.key, direction, batch)
        t.handles.append(handle)
        t.num_bytes += handle.num_bytes

    def _check_copies(self, t: Transfer) -> None:
        if t.state.is_terminal or (t.side is Side.SEND and t.mode is TransferMode.READ):
            return
        statuses = [self._transport.poll(h) for h in t.handles]
        if TransferStatus.PENDING in statuses:
            return
        failed = [h.error for h in t.handles if h.status is TransferStatus.FAILED]
        if failed:
            self._fail(t, f"copy failed: {failed[0]}")
        elif t.side is Side.SEND:
            if t.release_requested:
                self._fail(t, "decode released the transfer before it completed")
            elif t.remote_block_ids is not None and len(t.layers_submitted) == len(self._layout.layers):
                t.succeed()
                self._notifier.notify(t.peer, WriteDone(t.transfer_id, True))
                self._finish(t)
        elif t.mode is TransferMode.READ and t.handles and not t.confirming:
            if t.hold_expires_at is not None and time.time() > t.hold_expires_at - HOLD_MARGIN_S:
                self._fail(t, "the prefill instance's hold on the KV expired during the read")
            else:
                t.confirming = True
                self._pool.submit(self._confirm_read, t.peer, t.transfer_id, list(t.remote_block_ids or ()))

    def _confirm_read(self, peer: PeerAddress, transfer_id: str, block_ids: list[int]) -> None:
        try:
            reply = self._notifier.ask(peer, ReadDone(transfer_id, block_ids))
        except PDServeError as exc:
            reply = exc
        except Exception as exc:  # a confirmation thread must always report back
            reply = PDServeError(f"confirming the read failed: {exc}")
        self._inbox.put(("read_ack", transfer_id, reply))

    def _on_read_ack(self, transfer_id: str, reply) -> None:
        t = self._transfers.get(transfer_id)
        if t is None or t.state.is_terminal:
            return
        if isinstance(reply, ReadAck) and reply.ok:
            t.succeed()
            self._finish(t)
        elif isinstance(reply, ReadAck):
            self._fail(t, f"prefill did not confirm the KV it held: {reply.error}")
        else:
            self._fail(t, f"prefill did not confirm the KV it held: {reply}")

    def _expire(self, t: Transfer) -> None:
        if t.side is Side.RECV and t.mode is TransferMode.WRITE and not t.release_requested:
            # Tell P to stop, and wait (briefly) for its confirmation that no write is in flight.
            t.release_requested = True
            t.error = f"timed out after {self._config.transfer_timeout:.1f} s waiting for the prefill's KV"
            t.deadline = time.monotonic() + self._config.release_grace
            self._notifier.notify(t.peer, Release(t.transfer_id))
            return
        if t.side is Side.RECV and t.mode is TransferMode.WRITE:
            reason = t.error
        elif t.side is Side.SEND and t.mode is TransferMode.READ:
            self._holds.discard(t.transfer_id)
            reason = "decode never released the held KV blocks"
        elif t.side is Side.SEND and t.remote_block_ids is None:
            reason = "decode never announced its blocks"
        else:
            reason = f"timed out in state {t.state.value}"
        if any(self._transport.poll(h) is TransferStatus.PENDING for h in t.handles):
            return  # never free memory a copy is still touching; the copy itself is bounded
        self._fail(t, reason)

    def _fail(self, t: Transfer, reason: str) -> None:
        if t.state.is_terminal:
            return
        t.fail(reason)
        if t.peer is not None:
            if t.side is Side.SEND and t.mode is TransferMode.WRITE:
                self._notifier.notify(t.peer, WriteDone(t.transfer_id, False, reason))
            elif t.side is Side.RECV and t.mode is TransferMode.READ:
                self._notifier.notify(t.peer, Release(t.transfer_id))
        self._finish(t)

    def _finish(self, t: Transfer, track: bool = True) -> None:
        if track:
            self._transfers.pop(t.transfer_id, None)
            self._remember_terminal(t.transfer_id)
        self.stats.copy_seconds += sum(h.copy_seconds or 0.0 for h in t.handles)
        self.stats.copy_bytes += sum(h.num_bytes for h in t.handles if h.status is TransferStatus.DONE)
        if t.state is TransferState.DONE:
            self.stats.num_completed += 1
            self.stats.num_bytes += t.num_bytes
            self.stats.seconds.append(t.seconds)
        else:
            self.stats.num_failed += 1
            logger.error("pdserve: transfer %s (request %s) failed: %s [%s]", t.transfer_id, t.request_id,
                         t.error, t.describe())
        if t.side is Side.SEND:
            self._sent.add(t.request_id)
        else:
            self._finished.recving.add(t.request_id)
            if t.state is TransferState.FAILED:
                self._finished.failed_recving.add(t.request_id)

    def _remember_terminal(self, tid: str) -> None:
        self._terminal[tid] = None
        self._terminal.move_to_end(tid)
        while len(self._terminal) > MAX_TERMINAL_IDS:
            self._terminal.popitem(last=False)
