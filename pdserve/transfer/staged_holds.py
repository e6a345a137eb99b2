"""`StagedHolds`: P READ with host staging, the holds whose KV is known to have reached the host mirror.

Only such a hold answers D's read with ok (kinds/read_hold.py); the mark goes when the hold ends,
or the oldest beyond MAX_STAGED goes (its read is then refused: D recomputes).
"""

from __future__ import annotations

from collections import OrderedDict

MAX_STAGED = 4096  # holds remembered as staged; one forgotten is refused (fails closed)


class StagedHolds:
    def __init__(self):
        self._held: OrderedDict[str, None] = OrderedDict()

    def __contains__(self, transfer_id: str) -> bool:
        return transfer_id in self._held

    def __len__(self) -> int:
        return len(self._held)

    def succeeded(self, transfer_id: str) -> None:
        self._held[transfer_id] = None
        self._held.move_to_end(transfer_id)
        while len(self._held) > MAX_STAGED:
            self._held.popitem(last=False)

    def forget(self, transfer_id: str) -> None:
        self._held.pop(transfer_id, None)
