"""P, READ mode: hold the prompt's blocks until D has read them.

WAITING until D's `ReadDone` names this prompt and these blocks (DONE, acknowledged with
`ReadAck(ok)`), D's `Release` (FAILED) or the hold's expiry. Nothing is copied on this side (with
host staging the worker staged the blocks before the hold began; a read is acknowledged only for a
hold the engine knows reached the mirror, `TransferEngine.staged`: a failed, crashed or forgotten
staging refuses it, and D recomputes).
"""

from __future__ import annotations

from pdserve.connector.transfer import Transfer
from pdserve.connector.transfers.base import LegKind
from pdserve.control.messages import ReadDone, Release


class ReadHold(LegKind):
    def on_message(self, t: Transfer, sender: str, message, received: float) -> None:
        if isinstance(message, ReadDone):
            self._on_read_done(t, sender, message)
        elif isinstance(message, Release):
            t.fail("decode released the held KV without reading it")
            self.engine.finish(t)

    def expiry_reason(self, t: Transfer) -> str:
        return "decode never released the held KV blocks"

    def _on_read_done(self, t: Transfer, sender: str, message: ReadDone) -> None:
        if self.engine.staging is not None and (t.group or t.transfer_id) not in self.engine.staged:
            self.engine.messenger.ack(sender, message, f"transfer {t.transfer_id}'s KV is not known to have reached "
                                                       "host memory (its staging failed or never ran)")
        elif message.prompt_hash != t.prompt_hash:
            self.engine.messenger.ack(sender, message, f"transfer {t.transfer_id} holds the KV of a different prompt")
        elif tuple(message.block_ids) != t.local_block_ids:
            self.engine.messenger.ack(sender, message, f"transfer {t.transfer_id} holds blocks {list(t.local_block_ids)}, "
                                             f"not {list(message.block_ids)}")
        else:
            t.succeed()
            self.engine.messenger.ack(sender, message, "", self.engine.verifier.held(t))
            self.engine.finish(t)
