"""What the engine reports back to vLLM: finished requests per step, and transfer statistics."""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.transfer.record import Side, Transfer, TransferState
from pdserve.transport.base import TransferStatus


@dataclass
class Finished:
    sending: set[str] = field(default_factory=set)
    recving: set[str] = field(default_factory=set)
    failed_recving: set[str] = field(default_factory=set)


@dataclass
class TransferStats:
    num_completed: int = 0
    num_failed: int = 0
    num_bytes: int = 0
    seconds: list[float] = field(default_factory=list)  # per completed transfer: announced/held -> done
    transfer_bytes: list[int] = field(default_factory=list)  # per completed transfer, in `seconds`' order
    copy_seconds: float = 0.0  # time the transport spent copying (sum over batches)
    copy_bytes: int = 0  # bytes this side's transport copied
    num_fenced: int = 0  # transfers failed because their peer incarnation restarted or died
    num_refused: int = 0  # transfers refused because their peer is not in allowed_peers
    digest_seconds: float = 0.0  # kv_verify: time spent hashing KV blocks (P: what it sends; D: what landed)
    digest_mismatches: list[str] = field(default_factory=list)  # D: "transport:mode" per transfer that failed its digest

    def take(self) -> TransferStats:
        """What was counted since the last take; counting starts again from zero, in place (the
        engine's parts hold this object)."""
        taken = TransferStats(**vars(self))
        self.__init__()
        return taken

    def record(self, t: Transfer) -> None:
        """Count `t`, which has just reached DONE or FAILED."""
        handles = t.copies.handles
        self.copy_seconds += sum(h.copy_seconds or 0.0 for h in handles)
        self.copy_bytes += sum(h.num_bytes for h in handles if h.status is TransferStatus.DONE)
        if t.state is TransferState.DONE:
            self.num_completed += 1
            self.num_bytes += t.copies.num_bytes
            self.seconds.append(t.seconds)
            self.transfer_bytes.append(t.copies.num_bytes)
        else:
            self.num_failed += 1


class Completions:
    """Requests whose transfer ended, until vLLM is told. A send side is reported only once vLLM
    has also finished the request (its blocks are freed only then)."""

    def __init__(self):
        self._finished = Finished()
        self._sent: set[str] = set()  # request ids whose send side is over, not yet reported
        self._finished_requests: set[str] = set()  # finished by vLLM while their send side ran

    def ended(self, t: Transfer) -> None:
        """`t` has just reached DONE or FAILED."""
        self.request_ended(t.request_id, t.side, t.state is TransferState.FAILED)

    def request_ended(self, request_id: str, side: Side, failed: bool) -> None:
        """Every transfer of `request_id` on this side (of this rank) ended; `failed` if one did."""
        if side is Side.SEND:
            self._sent.add(request_id)
        else:
            self._finished.recving.add(request_id)
            if failed:
                self._finished.failed_recving.add(request_id)

    def take(self, finished_req_ids: set[str], sending: set[str]) -> Finished:
        """`finished_req_ids`: what vLLM finished this step; `sending`: requests still sending."""
        self._finished_requests |= finished_req_ids & (sending | self._sent)
        ready = self._sent & self._finished_requests
        self._sent -= ready
        self._finished_requests -= ready
        self._finished.sending |= ready
        out, self._finished = self._finished, Finished()
        return out

    @property
    def num_waiting(self) -> int:
        return len(self._finished_requests)
