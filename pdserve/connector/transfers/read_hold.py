"""P, READ mode: hold the prompt's blocks until D has read them.

WAITING until D's `ReadDone` names this prompt and these blocks (DONE, acknowledged with
`ReadAck(ok)`), D's `Release` (FAILED) or the hold's expiry. Nothing is copied on this side (with
host staging the worker staged the blocks before the hold began; a read of blocks that never
reached the mirror is answered with the reason).
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
        unstaged = self.engine.unstaged.get(t.group or t.transfer_id)
        if unstaged is not None:
            self.engine.messenger.ack(sender, message, f"transfer {t.transfer_id}'s KV never reached host memory: "
                                                       f"{unstaged}")
        elif message.prompt_hash != t.prompt_hash:
            self.engine.messenger.ack(sender, message, f"transfer {t.transfer_id} holds the KV of a different prompt")
        elif tuple(message.block_ids) != t.local_block_ids:
            self.engine.messenger.ack(sender, message, f"transfer {t.transfer_id} holds blocks {list(t.local_block_ids)}, "
                                             f"not {list(message.block_ids)}")
        else:
            t.succeed()
            self.engine.messenger.ack(sender, message, "")
            self.engine.finish(t)
