"""D, WRITE mode: announce our blocks to P and wait for its word.

WAITING until bound to P's incarnation, ANNOUNCED once `RemoteBlocks` granting a write window of
`write_for` seconds is queued, DONE on P's `WriteDone(ok)` for this prompt. A stopped transfer
fails (letting vLLM reuse the blocks) only when no copy of P can still land in them: P said it
stopped, P's incarnation died, or the window's fence passed.

The write window is a duration, never a time compared across hosts. D announces its blocks at
`announced_at` (its monotonic clock, taken before the message is queued) granting `write_for`
seconds; P, receiving it at `received` (its monotonic clock, stamped by the control-plane
thread), gives every copy the deadline `not_after = received + write_for - margin` (margin =
min(WRITE_MARGIN_S, write_for / 10), write_send.py), and its transport lets no byte land after a
copy's deadline (transport/base.py: stopped between chunks, aborted in flight, or counted as
still copying when that cannot be confirmed). D's fence is `announced_at + write_for +
release_grace`. As `received = announced_at + transit`, P's last byte lands by `announced_at +
write_for + transit - margin`, which is before D's fence whenever transit < release_grace +
margin: the assumption is that an announcement reaches P's control-plane thread within
release_grace (2 s by default) of being queued; clock skew between the hosts plays no part. A P
on this host that provably lives is not trusted to the fence alone (it may be frozen mid-copy):
D waits for its word until it has run on the CPU since the fence (see `_may_still_copy`).

With KV on a GPU staged in host memory P writes into D's host mirror: `WriteDone(ok)` starts the
land (mirror -> device), and the transfer is DONE once it landed. Only our own copy touches the
blocks from then on, so a failed or expired land fails the transfer as soon as it settled.
"""

from __future__ import annotations

import logging
import time

from pdserve.config import ConnectorConfig
from pdserve.control.messages import RemoteBlocks, WriteDone
from pdserve.transfer.binding import PeerBinding
from pdserve.transfer.copier import Copier
from pdserve.transfer.endings import Endings
from pdserve.transfer.kinds.base import TransferKind
from pdserve.transfer.messenger import Messenger
from pdserve.transfer.record import Transfer, TransferState, WriteWindow
from pdserve.transfer.verify import Verifier

logger = logging.getLogger("pdserve.connector")


class WriteRecv(TransferKind):
    def __init__(self, messenger: Messenger, endings: Endings, *, config: ConnectorConfig, binding: PeerBinding,
                 copier: Copier, verifier: Verifier, host_staging: bool):
        super().__init__(messenger, endings)
        self._config = config
        self._binding = binding
        self._copier = copier
        self._verifier = verifier
        self._host_staging = host_staging  # P writes into our host mirror: what it wrote is landed after

    def on_message(self, t: Transfer, sender: str, message, received: float) -> None:
        if isinstance(message, WriteDone):
            self._on_write_done(t, message)
        else:
            self.ignore(t, message)

    def on_peer(self, t: Transfer, peer) -> None:
        self._binding.bind(t)

    def on_bound(self, t: Transfer, peer) -> None:
        announced_at = time.monotonic()  # before it is queued: the fence counts from here
        write_for = max(0.0, t.deadline - announced_at)
        message = RemoteBlocks(t.transfer_id, list(t.local_block_ids), t.first_block, t.prompt_hash, write_for)
        if self._messenger.notify(t.peer, message, peer.key):
            t.announce(WriteWindow(announced_at, write_for))
        else:
            self._endings.stop(t, f"cannot reach the prefill instance at {t.peer.host}:{t.peer.notify_port}",
                             tell_peer=True)

    def expiry_reason(self, t: Transfer) -> str:
        if t.state is TransferState.ANNOUNCED:
            return f"timed out after {self._config.transfer_timeout:.1f} s waiting for the prefill's KV"
        if t.link.identity is None:
            return "could not reach the prefill instance in time"
        return super().expiry_reason(t)

    def on_stopping(self, t: Transfer) -> None:
        window = t.window
        if window is not None and window.fence is None:
            window.fence = window.announced_at + window.write_for + self._config.release_grace
            t.deadline = max(t.deadline, window.fence)

    def copies_settled(self, t: Transfer) -> None:
        if t.copies.handles:  # landed
            t.succeed()
            self._endings.finish(t)

    def may_fail(self, t: Transfer) -> bool:
        window = t.window
        if window is None or t.copies.handles:  # landing: P confirmed its write, and our copy settled
            return True
        if window.fence is not None and time.monotonic() < window.fence:
            return False  # P may still be copying into our blocks: wait for WriteDone or the fence
        return not self._may_still_copy(t, window)

    def _on_write_done(self, t: Transfer, message: WriteDone) -> None:
        if t.copies.handles:
            return  # landing already: P's word came
        if message.ok and t.window is None:
            t.fail("prefill confirmed a write of blocks decode never announced")
        elif message.ok and not t.stopping and message.prompt_hash == t.prompt_hash:
            mismatch = self._verifier.check(t, message.kv_digest)  # P's copies ended: nothing lands any more
            if mismatch:
                t.fail(mismatch)
                self._endings.finish(t)
                return
            t.copies.num_bytes = self._copier.bytes_to_move(t)
            if self._host_staging:
                self._copier.land(t)
                return  # DONE once landed (copies_settled)
            t.succeed()
        elif message.ok and not t.stopping:
            t.fail("prefill delivered the KV of a different prompt (prompt digests differ)")
        else:  # P stopped for good: no copy of it can touch our blocks any more
            t.fail(t.error or f"prefill could not deliver the KV: {message.error}")
        self._endings.finish(t)

    def _may_still_copy(self, t: Transfer, window: WriteWindow) -> bool:
        """Past the fence a P elsewhere cannot be observed from here, so for it the fence alone
        decides: its transport let no byte land after the window (module docstring). A P on this host
        that provably lives may instead be frozen mid-copy (stopped, or never scheduled) and land
        a chunk whenever it resumes, so D keeps waiting for its WriteDone (asking again with a
        Release every release_grace, in case the answer was lost) until that P has run on the
        CPU since the fence and one more transfer_timeout has passed: a running P's copy thread
        checks the deadline before every chunk and stops."""
        incarnation = t.link.incarnation
        if incarnation is None or not incarnation.same_host or incarnation.is_gone():
            return False
        config = self._config
        now = time.monotonic()
        cpu = incarnation.cpu_ticks()
        if window.peer_cpu_at_fence is None:
            window.peer_cpu_at_fence = cpu
        ran = cpu is not None and window.peer_cpu_at_fence is not None and cpu > window.peer_cpu_at_fence
        if ran and now >= (window.fence or 0.0) + config.transfer_timeout:
            logger.error("pdserve: prefill %s never confirmed it stopped writing transfer %s, though it ran since "
                         "its deadline; reusing its blocks", t.link.identity, t.transfer_id)
            return False
        if now >= window.next_release:
            window.next_release = now + config.release_grace
            self._messenger.notify(t.peer, self._messenger.release(t.transfer_id), t.link.identity)
        return True
