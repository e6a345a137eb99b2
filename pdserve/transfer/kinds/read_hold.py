"""P, READ mode: hold the prompt's blocks until D has read them.

WAITING until D's `ReadDone` names this prompt and these blocks (DONE, acknowledged with
`ReadAck(ok)`), D's `Release` (FAILED) or the hold's expiry. Nothing is copied on this side (with
host staging the worker staged the blocks before the hold began; a read is acknowledged only for a
hold known to have reached the mirror (`StagedHolds`, staged_holds.py): a failed, crashed or forgotten
staging refuses it, and D recomputes).
"""

from __future__ import annotations

from pdserve.control.messages import ReadDone, Release
from pdserve.transfer.endings import Endings
from pdserve.transfer.kinds.base import TransferKind
from pdserve.transfer.messenger import Messenger
from pdserve.transfer.record import Transfer
from pdserve.transfer.staged_holds import StagedHolds
from pdserve.transfer.verify import Verifier


class ReadHold(TransferKind):
    def __init__(self, messenger: Messenger, endings: Endings, *, verifier: Verifier, host_staging: bool,
                 staged: StagedHolds):
        super().__init__(messenger, endings)
        self._verifier = verifier
        self._host_staging = host_staging  # only a hold known to have reached the host mirror is read
        self._staged = staged

    def on_message(self, t: Transfer, sender: str, message, received: float) -> None:
        if isinstance(message, ReadDone):
            self._on_read_done(t, sender, message)
        elif isinstance(message, Release):
            t.fail("decode released the held KV without reading it")
            self._endings.finish(t)

    def expiry_reason(self, t: Transfer) -> str:
        return "decode never released the held KV blocks"

    def _on_read_done(self, t: Transfer, sender: str, message: ReadDone) -> None:
        if self._host_staging and (t.group or t.transfer_id) not in self._staged:
            self._messenger.ack(sender, message, f"transfer {t.transfer_id}'s KV is not known to have reached "
                                                       "host memory (its staging failed or never ran)")
        elif message.prompt_hash != t.prompt_hash:
            self._messenger.ack(sender, message, f"transfer {t.transfer_id} holds the KV of a different prompt")
        elif tuple(message.block_ids) != t.local_block_ids:
            self._messenger.ack(sender, message, f"transfer {t.transfer_id} holds blocks {list(t.local_block_ids)}, "
                                             f"not {list(message.block_ids)}")
        else:
            t.succeed()
            self._messenger.ack(sender, message, "", self._verifier.held(t))
            self._endings.finish(t)
