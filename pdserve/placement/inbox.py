"""PlacementInbox: the worker half's side of per-request placement, and the `WorkerNews` it collects.

P: prefill legs waiting for their decode instance's decision, and the decisions that arrived (D's
RemoteBlocks means "prefill here", D's Release before any send means "D prefills it"); in READ
mode, the latest status each decode instance published (P decides there). D: the latest load each
prefill instance published. The scheduler half collects them once per step as `WorkerNews`. Runs
on the worker thread only. Free of vLLM.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field

from pdserve.placement.messages import DecodeStatus, PrefillLoad

MAX_AWAITING = 4096
PUBLISH_EVERY_S = 0.02  # P sends its load to its decode instances (D, READ: its status to P) at most this often


@dataclass
class WorkerNews:
    """What the worker half tells the scheduler half each step (vLLM's kv_connector_worker_meta):
    P: placement decisions D sent (request id -> True: prefill here, False: D prefills it);
    D: the latest load each prefill instance published, by (host, handshake port). P, READ: the
    latest status each decode instance published, by (host, handshake port) (read_mode.py)."""

    decided: dict[str, bool] = field(default_factory=dict)
    loads: dict[tuple[str, int], PrefillLoad] = field(default_factory=dict)
    statuses: dict[tuple[str, int], DecodeStatus] = field(default_factory=dict)

    def merge(self, other: "WorkerNews") -> "WorkerNews":
        self.decided.update(other.decided)
        self.loads.update(other.loads)
        self.statuses.update(other.statuses)
        return self

    def __bool__(self) -> bool:
        return bool(self.decided or self.loads or self.statuses)


class PlacementInbox:
    def __init__(self, expiry_s: float):
        self._expiry_s = expiry_s
        self._awaiting: OrderedDict[str, tuple[str, float]] = OrderedDict()  # transfer id -> (request id, expiry)
        self._news = WorkerNews()
        self._next_publish = 0.0
        self._published: object = None  # the content of the last publish_due that said yes

    # ---- P ---------------------------------------------------------------------------------

    def expect(self, request_id: str, transfer_id: str, known: bool | None) -> None:
        """A prefill leg asks for its decision; `known` when the engine already has D's word."""
        if known is not None:
            self._news.decided[request_id] = known
            return
        self._awaiting[transfer_id] = (request_id, time.monotonic() + self._expiry_s)
        while len(self._awaiting) > MAX_AWAITING:
            self._awaiting.popitem(last=False)

    @property
    def waiting(self) -> bool:
        """Legs wait for D's word: an idle step may block briefly for it instead of spinning."""
        return bool(self._awaiting)

    def decided(self, transfer_id: str, prefill_here: bool) -> None:
        entry = self._awaiting.pop(transfer_id, None)
        if entry is not None:
            self._news.decided[entry[0]] = prefill_here

    def on_status(self, status: DecodeStatus) -> None:
        """READ: a decode instance's side of the placements P decides (read_mode.py)."""
        self._news.statuses[(status.decode_host, status.decode_handshake_port)] = status

    def publish_due(self, content: object = None) -> bool:
        """Whether to publish now: at most every PUBLISH_EVERY_S, and at once when `content` (what
        the receivers act on) differs from the last published. P's queue changes at the start of
        the step that computes a new prompt; a rate limit alone would drop that load whenever an
        empty step had published within the period, and D would see no queue for the whole step."""
        now = time.monotonic()
        if now < self._next_publish and (content is None or content == self._published):
            return False
        self._next_publish = now + PUBLISH_EVERY_S
        self._published = content
        return True

    # ---- D ---------------------------------------------------------------------------------

    def on_load(self, load: PrefillLoad) -> None:
        self._news.loads[(load.prefill_host, load.prefill_handshake_port)] = load

    # ---- both ------------------------------------------------------------------------------

    def take(self) -> WorkerNews | None:
        now = time.monotonic()
        while self._awaiting and next(iter(self._awaiting.values()))[1] < now:
            self._awaiting.popitem(last=False)
        if not self._news:
            return None
        news, self._news = self._news, WorkerNews()
        return news
