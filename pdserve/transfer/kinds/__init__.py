"""The kinds of transfer: one unit per (side, mode), each a `TransferKind` (base.py).

`TransferEngine` (engine.py) owns the running transfers; its parts hand each event to the unit of
the transfer's kind (`KindTable`, hooks.py):

- `WriteSend`  (write_send.py): P, WRITE mode: writes its prompt KV into D's announced blocks.
- `ReadHold`   (read_hold.py):  P, READ mode: holds its blocks until D has read them.
- `WriteRecv`  (write_recv.py): D, WRITE mode: announces its blocks, waits for P's word; the fence.
- `ReadRecv`   (read_recv.py):  D, READ mode: reads P's held blocks, then asks P to confirm.

What they are built with, and share with the engine: `Endings` (endings.py: stop and finish a
transfer), `Messenger` (messenger.py: every outgoing control message), `PeerBinding`
(binding.py: which peer incarnation a transfer talks to), `Copier` (copier.py: its copies),
`Verifier` (verify.py: KV digests), `StagedHolds` (staged_holds.py).

A new kind of transfer is a new `TransferKind` subclass here, registered in `transfer_kinds`.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.config import ConnectorConfig, TransferMode
from pdserve.transfer.binding import PeerBinding
from pdserve.transfer.copier import Copier
from pdserve.transfer.endings import Endings
from pdserve.transfer.kinds.base import TransferKind
from pdserve.transfer.kinds.read_hold import ReadHold
from pdserve.transfer.kinds.read_recv import ReadRecv
from pdserve.transfer.kinds.write_recv import WriteRecv
from pdserve.transfer.kinds.write_send import WriteSend
from pdserve.transfer.messenger import Messenger
from pdserve.transfer.record import Side
from pdserve.transfer.staged_holds import StagedHolds
from pdserve.transfer.verify import Verifier


@dataclass(frozen=True)
class KindParts:
    """The engine's parts the kinds are built with (each kind takes the ones it uses)."""

    config: ConnectorConfig
    messenger: Messenger
    endings: Endings
    binding: PeerBinding
    copier: Copier
    verifier: Verifier
    staged: StagedHolds
    host_staging: bool  # KV on a GPU staged in host memory
    num_layers: int


def transfer_kinds(parts: KindParts) -> dict[tuple[Side, TransferMode], TransferKind]:
    """The unit of each (side, mode), built with the parts it uses."""
    p = parts
    return {
        (Side.SEND, TransferMode.WRITE): WriteSend(p.messenger, p.endings, config=p.config, binding=p.binding,
                                                   copier=p.copier, verifier=p.verifier, num_layers=p.num_layers),
        (Side.SEND, TransferMode.READ): ReadHold(p.messenger, p.endings, verifier=p.verifier,
                                                 host_staging=p.host_staging, staged=p.staged),
        (Side.RECV, TransferMode.WRITE): WriteRecv(p.messenger, p.endings, config=p.config, binding=p.binding,
                                                   copier=p.copier, verifier=p.verifier, host_staging=p.host_staging),
        (Side.RECV, TransferMode.READ): ReadRecv(p.messenger, p.endings, config=p.config, binding=p.binding,
                                                 copier=p.copier, verifier=p.verifier, num_layers=p.num_layers),
    }
