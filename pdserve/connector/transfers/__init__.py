"""The transfer engine's parts: one unit per kind of leg, and the mechanics they share.

`TransferEngine` (engine.py) owns the running transfers and hands each event to the unit of the
transfer's kind (`LegKind`, base.py):

- `WriteSend`  (write_send.py): P, WRITE mode: writes its prompt KV into D's announced blocks.
- `ReadHold`   (read_hold.py):  P, READ mode: holds its blocks until D has read them.
- `WriteRecv`  (write_recv.py): D, WRITE mode: announces its blocks, waits for P's word; the fence.
- `ReadRecv`   (read_recv.py):  D, READ mode: reads P's held blocks, then asks P to confirm.

What they share: `PeerBinding` (binding.py: which peer incarnation a transfer talks to),
`Messenger` (messenger.py: every outgoing control message), `TransferRecords` (records.py: ended
ids, early messages), `Completions`/`TransferStats` (completions.py: what is reported to vLLM),
`PlacementLink` (placement_link.py: the engine's side of adaptive placement).

A new kind of leg is a new `LegKind` subclass here, registered in `leg_kinds`.
"""

from __future__ import annotations

from pdserve.config import TransferMode
from pdserve.connector.transfer import Side
from pdserve.connector.transfers.base import LegKind
from pdserve.connector.transfers.read_hold import ReadHold
from pdserve.connector.transfers.read_recv import ReadRecv
from pdserve.connector.transfers.write_recv import WriteRecv
from pdserve.connector.transfers.write_send import WriteSend


def leg_kinds(engine) -> dict[tuple[Side, TransferMode], LegKind]:
    """The unit of each (side, mode), bound to `engine`."""
    return {
        (Side.SEND, TransferMode.WRITE): WriteSend(engine),
        (Side.SEND, TransferMode.READ): ReadHold(engine),
        (Side.RECV, TransferMode.WRITE): WriteRecv(engine),
        (Side.RECV, TransferMode.READ): ReadRecv(engine),
    }
