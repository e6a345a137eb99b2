"""`Groups`: one request's transfer on this rank as the sub-transfers of its rank pairs (fanout.py),
their endings joined into one report to `Completions`: the request ends once every sub-transfer
ended, and failed if any did."""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.transfer.completions import Completions
from pdserve.transfer.record import Side, Transfer, TransferState


@dataclass
class Group:
    """The sub-transfers of one transfer on this rank."""

    request_id: str
    side: Side
    open: int  # sub-transfers not yet ended
    failed: bool = False


class Groups:
    def __init__(self, completions: Completions):
        self._completions = completions
        self._groups: dict[str, Group] = {}  # transfer id -> its sub-transfers on this rank

    def __contains__(self, transfer_id: str) -> bool:
        return transfer_id in self._groups

    def open(self, transfer_id: str, request_id: str, side: Side, members: int) -> None:
        self._groups[transfer_id] = Group(request_id, side, members)

    def ended(self, t: Transfer) -> bool:
        """`t` ended; True when it belongs to a group (whose report waits for its last member)."""
        group = self._groups.get(t.group) if t.group else None
        if group is None:
            return False
        group.open -= 1
        group.failed |= t.state is TransferState.FAILED
        if group.open <= 0:
            self.end(t.group)
        return True

    def end(self, transfer_id: str) -> None:
        """Report the request of group `transfer_id` as ended."""
        group = self._groups.pop(transfer_id)
        self._completions.request_ended(group.request_id, group.side, group.failed)

    def failed_unsplit(self, request_id: str, side: Side) -> None:
        """A transfer cancelled before it was split: report its request as failed."""
        self._completions.request_ended(request_id, side, True)
