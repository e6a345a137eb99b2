"""D, READ mode: read P's held blocks, then ask P to confirm it held them throughout.

WAITING until bound to P's incarnation, COPYING while the reads run, CONFIRMING once they all
landed (`ReadDone` sent), DONE on P's `ReadAck(ok)`; any failure stops it and releases P's hold.
The reads carry the transfer's deadline as their `not_after`; one the transport cannot stop (a
NIXL get) keeps its handle pending until it ended, and the engine fails the transfer, letting
vLLM reuse the blocks, only then.
"""

from __future__ import annotations

from pdserve.control.messages import ReadAck, ReadDone
from pdserve.transfer.kinds.copying import CopyingKind
from pdserve.transfer.record import Transfer, TransferState
from pdserve.transport.base import Direction


class ReadRecv(CopyingKind):
    def on_message(self, t: Transfer, sender: str, message, received: float) -> None:
        if isinstance(message, ReadAck):
            self._on_read_ack(t, message)
        else:
            self.ignore(t, message)

    def on_peer(self, t: Transfer, peer) -> None:
        self._binding.bind(t)

    def on_bound(self, t: Transfer, peer) -> None:
        self._try_read(t)

    def on_rebind(self, t: Transfer) -> None:
        self._try_read(t)

    def copies_settled(self, t: Transfer) -> None:
        if t.state is TransferState.COPYING:
            t.confirm()
            config = self._config
            self._messenger.notify(t.peer, ReadDone(t.transfer_id, list(t.remote_block_ids or ()), t.prompt_hash,
                                                config.host_ip, config.notify_port), t.link.identity)

    def expiry_reason(self, t: Transfer) -> str:
        if t.link.identity is None:
            return "could not reach the prefill instance in time"
        return super().expiry_reason(t)

    def _try_read(self, t: Transfer) -> None:
        if t.state is not TransferState.WAITING or t.copies.handles:
            return
        peer = self._binding.bound_peer(t)
        if peer is not None:
            t.copies.not_after = t.deadline  # a read still running then is stopped, or waited for till it ended
            self._copier.submit(t, peer, Direction.READ, range(self._num_layers))

    def _on_read_ack(self, t: Transfer, message: ReadAck) -> None:
        if t.state is not TransferState.CONFIRMING:
            return
        if message.ok:
            mismatch = self._verifier.check(t, message.kv_digest)  # our reads ended
            if mismatch:
                t.fail(mismatch)
            else:
                t.succeed()
            self._endings.finish(t)
        else:
            self._endings.stop(t, f"prefill did not confirm the KV it held: {message.error}", tell_peer=True)
