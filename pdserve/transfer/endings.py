"""`Endings`: how a running transfer winds down and ends, and what its end reports.

`stop` cancels a transfer's queued copies and tells its kind; the transfer fails only once nothing
can touch its blocks any more (`conclude_stop`: no copy pending, and its kind agrees). `finish`
takes a DONE or FAILED transfer out of the running ones, remembers its id, counts it and reports
its request (or its group's, once the group's last member ended).
"""

from __future__ import annotations

import logging

from pdserve.config import TransferMode
from pdserve.transfer.completions import Completions, TransferStats
from pdserve.transfer.groups import Groups
from pdserve.transfer.history import TransferHistory
from pdserve.transfer.hooks import KindTable
from pdserve.transfer.record import RELEASED_BY_DECODE, Side, Transfer, TransferState
from pdserve.transfer.staged_holds import StagedHolds
from pdserve.transport.base import Transport

logger = logging.getLogger("pdserve.connector")


class Endings:
    def __init__(self, transport: Transport, kinds: KindTable, running: dict[str, Transfer],
                 history: TransferHistory, stats: TransferStats, staged: StagedHolds, groups: Groups,
                 completions: Completions):
        self._transport = transport
        self._kinds = kinds
        self._running = running  # transfer id -> transfer, shared with the engine
        self._history = history
        self._stats = stats
        self._staged = staged
        self._groups = groups
        self._completions = completions

    def stop(self, t: Transfer, reason: str, tell_peer: bool) -> None:
        """Wind `t` down: no new copies, queued ones cancelled; it fails once nothing can touch
        its blocks any more (see `conclude_stop`)."""
        if t.state.is_terminal:
            return
        if t.stop(reason):
            for handle in t.copies.pending:
                self._transport.cancel(handle)
            self._kinds.of(t).on_stopping(t)
            if tell_peer and t.peer is not None:
                self._kinds.of(t).tell_stopped(t)
        self.conclude_stop(t)

    def conclude_stop(self, t: Transfer) -> None:
        if t.state.is_terminal or t.copies.pending:
            return  # never free memory a copy is still touching; copies are bounded
        kind = self._kinds.of(t)
        if kind.may_fail(t):
            kind.before_fail(t)
            t.fail(t.error)
            self.finish(t)

    def finish(self, t: Transfer, track: bool = True, quiet: bool = False) -> None:
        """`t` reached DONE or FAILED: account for it and report its request."""
        if track:
            self._running.pop(t.transfer_id, None)
            self._history.remember_terminal(t.transfer_id, t.peer if t.side is Side.SEND else None)
            held = t.group or t.transfer_id
            if t.mode is TransferMode.READ and t.side is Side.SEND and held in self._staged and \
                    not any((o.group or o.transfer_id) == held for o in self._running.values()):
                self._staged.forget(held)  # the hold (each D rank's part of it) ended
        self._stats.record(t)
        if t.state is TransferState.FAILED:
            log = logger.info if quiet or t.error == RELEASED_BY_DECODE else logger.error
            log("pdserve: transfer %s (request %s) failed: %s [%s]", t.transfer_id, t.request_id,
                t.error, t.describe())
        if not self._groups.ended(t):
            self._completions.ended(t)
