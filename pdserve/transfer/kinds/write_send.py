"""P, WRITE mode: write the prompt's KV, layer by layer, into the blocks D announced.

WAITING until D's `RemoteBlocks` names its blocks (and the layers are computed), COPYING while
they move, DONE with `WriteDone(ok)` once every layer landed. Each copy carries the deadline of
D's write window (`not_after`, see write_recv.py); a stop says `WriteDone(ok=False)` only once no copy
of ours is pending.
"""

from __future__ import annotations

import time

from pdserve.control.messages import Release, RemoteBlocks, WriteDone
from pdserve.transfer.kinds.copying import CopyingKind
from pdserve.transfer.record import RELEASED_BY_DECODE, Transfer
from pdserve.transport.base import Direction

WRITE_MARGIN_S = 0.25  # P ends its write window this much (at most a tenth of it) before D's grant ends


class WriteSend(CopyingKind):
    def on_message(self, t: Transfer, sender: str, message, received: float) -> None:
        if isinstance(message, RemoteBlocks):
            self._on_remote_blocks(t, sender, message, received)
        elif isinstance(message, Release):
            t.link.identity = sender
            self._endings.stop(t, RELEASED_BY_DECODE, tell_peer=True)

    def on_peer(self, t: Transfer, peer) -> None:
        if peer.refused_by:
            super().on_peer(t, peer)
        else:
            self.try_write(t)

    def try_write(self, t: Transfer) -> None:
        """Submit the layers computed but not yet sent, once D's blocks are known."""
        if t.state.is_terminal or t.stopping or t.remote_block_ids is None:
            return
        layers = t.copies.layers_ready - t.copies.layers_submitted
        if not layers:
            return
        peer = self._binding.bound_peer(t)
        if peer is not None:
            self._copier.submit(t, peer, Direction.WRITE, layers)
            t.copies.layers_submitted |= layers

    def copies_settled(self, t: Transfer) -> None:
        if t.remote_block_ids is not None and len(t.copies.layers_submitted) == self._num_layers:
            t.succeed()
            done = WriteDone(t.transfer_id, True, "", t.prompt_hash, self._verifier.sent(t))
            self._messenger.notify(t.peer, done, t.link.identity)
            self._endings.finish(t)

    def expiry_reason(self, t: Transfer) -> str:
        if t.remote_block_ids is None:
            return "decode never announced its blocks"
        return super().expiry_reason(t)

    def tell_stopped(self, t: Transfer) -> None:
        pass  # WriteDone(False) goes out in before_fail, once no copy of ours is running

    def before_fail(self, t: Transfer) -> None:
        done = WriteDone(t.transfer_id, False, t.error)
        if t.link.identity is not None:
            self._messenger.notify(t.peer, done, t.link.identity)
        else:
            self._messenger.send(t.peer, done)

    def _on_remote_blocks(self, t: Transfer, sender: str, message: RemoteBlocks, received: float) -> None:
        if t.remote_block_ids is not None or t.stopping:
            return  # a duplicate, or too late
        t.link.identity = sender
        if message.prompt_hash != t.prompt_hash:
            self._endings.stop(t, "decode announced blocks for a different prompt (prompt digests differ)",
                             tell_peer=True)
            return
        if len(message.block_ids) != len(t.local_block_ids):
            self._endings.stop(t, f"block counts differ: prefill has {len(t.local_block_ids)}, decode announced "
                                f"{len(message.block_ids)}", tell_peer=True)
            return
        t.remote_block_ids, t.first_block = tuple(message.block_ids), message.first_block
        window = min(message.write_for, self._config.defer_timeout)
        t.copies.not_after = received + window - min(WRITE_MARGIN_S, window / 10)
        if t.copies.not_after <= time.monotonic():
            self._endings.stop(t, "decode's write deadline passed before its blocks could be written", tell_peer=True)
            return
        self.try_write(t)
