"""`PlacementLink`: the transfer engine's side of adaptive placement (the policy is pdserve/placement/).

P: a prefill transfer waits for D's word (D's `RemoteBlocks` or `Release` for its transfer decides
it), and P's load goes to every decode instance it knows. D: P's loads are heard, and D's status
goes to every prefill instance it knows. Both publications are rate-limited by `PlacementInbox`.
"""

from __future__ import annotations

from pdserve.config import ConnectorConfig, Role
from pdserve.control.messages import Release, RemoteBlocks
from pdserve.placement import DecodeStatus, PlacementInbox, PrefillLoad, WorkerNews
from pdserve.transfer.history import TransferHistory
from pdserve.transfer.messenger import Messenger
from pdserve.transfer.peers import PeerTable
from pdserve.transfer.specs import AwaitSpec

PLACEMENT_MESSAGES = (PrefillLoad, DecodeStatus)


class PlacementLink:
    def __init__(self, config: ConnectorConfig, messenger: Messenger, peers: PeerTable, history: TransferHistory):
        self._role = config.role
        self._messenger = messenger
        self._peers = peers
        self._history = history
        self._inbox = PlacementInbox(config.defer_timeout)

    @property
    def waiting(self) -> bool:
        """Some transfer waits for D's word."""
        return self._inbox.waiting

    def await_decision(self, spec: AwaitSpec, running: bool) -> None:
        """P: the prefill transfer of `spec` waits for D's word; `running`: its transfer runs already."""
        tid = spec.transfer_id
        if tid in self._history.terminal or running:
            known = tid not in self._history.terminal
        elif self._history.announced_early(tid):
            known = True
        else:
            known = None
            self._peers.lookup(spec.peer)  # handshake D now: its blocks and our load reports need it
        self._inbox.expect(spec.request_id, spec.transfer_id, known)

    def publish_load(self, load: PrefillLoad) -> None:
        """P: tell every decode instance we know how busy we are (rate-limited, but at once when
        the queue D counts on changed)."""
        if self._inbox.publish_due((load.queued_tokens, tuple(load.counted_transfers), load.decodes)):
            self._messenger.broadcast(load)

    def publish_status(self, status: DecodeStatus) -> None:
        """D, READ: tell every prefill instance we know our side of its placement decisions (rate-limited)."""
        if self._inbox.publish_due():
            self._messenger.broadcast(status)

    def take_news(self) -> WorkerNews | None:
        return self._inbox.take()

    def on_message(self, message: PrefillLoad | DecodeStatus) -> None:
        """A load (heard by D) or a status (heard by P); the other role ignores it."""
        if isinstance(message, PrefillLoad) and self._role is Role.CONSUMER:
            self._inbox.on_load(message)
        elif isinstance(message, DecodeStatus) and self._role is Role.PRODUCER:
            self._inbox.on_status(message)

    def on_unknown(self, tid: str, message) -> None:
        """P: D's word for a transfer that does not run (yet): it decides a waiting transfer."""
        if self._role is Role.PRODUCER and isinstance(message, (RemoteBlocks, Release)):
            self._inbox.decided(tid, isinstance(message, RemoteBlocks))
