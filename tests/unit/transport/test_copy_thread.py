"""CopyThreadTransport, the base of ShmTransport and NixlTransport, with a backend that finishes
copies later, from `_progress`: the shared queue, admission and shutdown rules."""

from __future__ import annotations

import threading
import time

from pdserve.transport import CopyOp, Direction, RegionOps, TransferStatus
from pdserve.transport.copy_thread import CopyThreadTransport, Job

ONE_COPY = [RegionOps(0, (CopyOp(0, 0, 8),))]


class LaterBackend(CopyThreadTransport):
    """Finishes each admitted batch on the second `_progress` after it began; `gate` holds the copy thread."""

    def __init__(self):
        super().__init__("later")
        self.gate = threading.Event()
        self.gate.set()
        self.in_flight: list[list] = []
        self.num_closed = 0
        self._start_copy_thread()

    def attach_peer(self, peer_id, descriptors):
        pass

    def detach_peer(self, peer_id):
        pass

    def _copy(self, job: Job) -> None:
        self.gate.wait(10)
        self.in_flight.append([job.handle, 0])

    def _poll_interval(self):
        return 0.001 if self.in_flight else None

    def _progress(self) -> None:
        for flight in list(self.in_flight):
            flight[1] += 1
            if flight[1] == 2:
                self.in_flight.remove(flight)
                flight[0].finish(TransferStatus.DONE)

    def _close_backend(self) -> None:
        self.num_closed += 1


def test_copies_in_flight_finish_without_new_batches():
    transport = LaterBackend()
    handles = [transport.submit("peer", Direction.WRITE, ONE_COPY) for _ in range(3)]
    assert all(transport.wait(h, 5) is TransferStatus.DONE for h in handles)
    transport.close()


def test_a_batch_is_checked_when_its_turn_comes():
    transport = LaterBackend()
    transport.gate.clear()
    first = transport.submit("peer", Direction.WRITE, ONE_COPY)
    late = transport.submit("peer", Direction.READ, ONE_COPY, not_after=time.monotonic() + 0.05)
    cancelled = transport.submit("peer", Direction.READ, ONE_COPY)
    assert transport.cancel(cancelled)
    time.sleep(0.1)  # the thread holds `first` past `late`'s deadline
    transport.gate.set()
    assert transport.wait(first, 5) is TransferStatus.DONE
    assert transport.wait(late, 5) is TransferStatus.FAILED and "deadline passed" in late.error
    assert cancelled.error == "cancelled"
    transport.close()


def test_close_cancels_the_queue_then_closes_the_backend_once():
    transport = LaterBackend()
    transport.gate.clear()
    transport.submit("peer", Direction.WRITE, ONE_COPY)
    queued = transport.submit("peer", Direction.READ, ONE_COPY)
    time.sleep(0.05)  # the thread holds the first batch; `queued` waits
    closing = threading.Thread(target=transport.close)
    closing.start()
    transport.gate.set()
    closing.join(10)
    assert not closing.is_alive() and transport.num_closed == 1
    assert queued.status is TransferStatus.FAILED and "closed before the transfer ran" in queued.error
    after = transport.submit("peer", Direction.WRITE, ONE_COPY)
    assert after.status is TransferStatus.FAILED and "is closed" in after.error
    transport.close()
    assert transport.num_closed == 1, "close is idempotent"
