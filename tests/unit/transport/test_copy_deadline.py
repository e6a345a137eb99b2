"""No byte of a batch lands after its `not_after` deadline: the shared-memory copy stops between
chunks, a NIXL request in flight is aborted, and one NIXL cannot abort counts as still copying."""

import os
import threading
import time

import numpy as np
import pytest

from pdserve.errors import TransferError
from pdserve.transport import (
    CopyOp,
    Direction,
    RegionDescriptor,
    RegionOps,
    SharedSegment,
    ShmTransport,
    TransferStatus,
    segment_name,
)
from pdserve.transport import shm as shm_module
from pdserve.transport.nixl_agent import XferState

SIZE = 4096
CHUNK = 1024
DEADLINE_S = 20.0


@pytest.fixture
def shm_pair():
    local = SharedSegment.create(segment_name("deadline", "local"), SIZE)
    remote = SharedSegment.create(segment_name("deadline", "remote"), SIZE)
    transport = ShmTransport(name="deadlinetest")
    transport.register_region(0, local.address, SIZE, local.name)
    transport.attach_peer("peer", [RegionDescriptor(0, SIZE, remote.name, None)])
    np.frombuffer(local.mmap, dtype=np.uint8)[:] = 7
    yield transport, np.frombuffer(remote.mmap, dtype=np.uint8)
    transport.close()
    local.close()
    remote.close()


def test_shm_copy_that_reaches_its_deadline_mid_batch_moves_no_further_chunk(shm_pair, monkeypatch):
    transport, remote = shm_pair
    monkeypatch.setattr(shm_module, "CHUNK_BYTES", CHUNK)
    checks = []

    def past(deadline):  # the deadline passes after the first chunk has moved
        checks.append(deadline)
        return len(checks) > 1

    monkeypatch.setattr(shm_module, "past", past)
    handle = transport.submit("peer", Direction.WRITE, [RegionOps(0, (CopyOp(0, 0, 3 * CHUNK),))],
                              not_after=time.monotonic() + 60)
    assert transport.wait(handle, DEADLINE_S) is TransferStatus.FAILED
    assert handle.error == f"deadline passed during the copy ({CHUNK} of {3 * CHUNK} bytes moved)"
    assert (remote[:CHUNK] == 7).all() and not remote[CHUNK:].any(), "a chunk moved after the deadline"


def test_shm_copy_stalled_past_its_deadline_after_admission_moves_nothing(shm_pair):
    transport, remote = shm_pair
    stalled = threading.Event()
    transport.set_stall_hook(lambda direction: (stalled.set(), time.sleep(0.2)))
    handle = transport.submit("peer", Direction.WRITE, [RegionOps(0, (CopyOp(0, 0, SIZE),))],
                              not_after=time.monotonic() + 0.1)
    assert transport.wait(handle, DEADLINE_S) is TransferStatus.FAILED
    assert stalled.is_set() and handle.error == "deadline passed before the copy started"
    assert not remote.any()


class FakeAgent:
    """A NIXL agent whose requests stay in flight until released; `release` fails while `stuck`."""

    def __init__(self):
        self.stuck = False
        self.released: list[int] = []
        self.posted = 0

    def register(self, address, size, memory):
        pass

    def add_remote(self, metadata):
        return "peer"

    def remove_remote(self, name):
        pass

    def post(self, write, local, remote, remote_name, local_segment="DRAM", remote_segment="DRAM"):
        self.posted += 1
        return self.posted, XferState.IN_PROGRESS

    def state(self, request):
        return XferState.IN_PROGRESS

    def release(self, request):
        if self.stuck:
            raise TransferError("NIXL cannot release a transfer: busy")
        self.released.append(request)

    def close(self):
        pass


@pytest.fixture
def fake_nixl():
    from pdserve.transport.nixl import NixlTransport

    agent, stuck_writes = FakeAgent(), []
    local = np.zeros(SIZE, dtype=np.uint8)
    transport = NixlTransport("local", agent=agent, copy_timeout_s=60, on_stuck_write=stuck_writes.append)
    transport.register_region(0, local.ctypes.data, SIZE)
    transport.attach_peer("peer", [RegionDescriptor(0, SIZE, None, 1 << 20)], b"metadata")
    yield transport, agent, stuck_writes
    agent.stuck = False
    transport.close()


def test_nixl_request_in_flight_at_its_deadline_is_aborted_and_fails(fake_nixl):
    transport, agent, stuck_writes = fake_nixl
    not_after = time.monotonic() + 0.1
    handle = transport.submit("peer", Direction.WRITE, [RegionOps(0, (CopyOp(0, 0, SIZE),))], not_after=not_after)
    assert transport.wait(handle, DEADLINE_S) is TransferStatus.FAILED
    assert "deadline passed during the copy" in handle.error and agent.released == [1]
    assert handle.finished - not_after < 0.5, "the request ran on past its deadline"
    assert stuck_writes == []


@pytest.mark.parametrize("direction", [Direction.WRITE, Direction.READ])
def test_nixl_request_that_cannot_be_aborted_counts_as_still_copying(fake_nixl, direction):
    transport, agent, stuck_writes = fake_nixl
    agent.stuck = True
    handle = transport.submit("peer", direction, [RegionOps(0, (CopyOp(0, 0, SIZE),))], not_after=time.monotonic() + 0.05)
    time.sleep(0.3)
    assert handle.status is TransferStatus.PENDING, "a copy NIXL could not abort was reported as ended"
    if direction is Direction.WRITE:
        assert len(stuck_writes) == 1 and "could not abort" in stuck_writes[0]  # the process would end here
    else:
        assert stuck_writes == []
    agent.stuck = False
    assert transport.wait(handle, DEADLINE_S) is TransferStatus.FAILED
    assert "deadline passed during the copy" in handle.error


def test_real_nixl_read_still_in_flight_at_its_deadline_is_aborted(monkeypatch):
    """Two real agents over TCP: a 256 MiB read given a deadline a quarter of its run time fails
    at that deadline instead of running to the 30 s copy timeout."""
    pytest.importorskip("nixl_cu12", reason="the nixl extra is part of the test environment (scripts/bootstrap.sh)")
    from pdserve.transport.nixl import NixlTransport
    from tests.unit.transport.test_nixl_transport import BIG, Peer

    monkeypatch.setenv("UCX_TLS", "tcp,self")
    peer = Peer(BIG)
    local = np.zeros(BIG, dtype=np.uint8)
    local[::4096] = 1
    transport = NixlTransport(f"local-{os.getpid()}")
    try:
        transport.register_region(0, local.ctypes.data, BIG)
        transport.attach_peer("peer", peer.descriptors, peer.endpoint)
        whole = [RegionOps(0, (CopyOp(0, 0, BIG),))]
        warm = transport.submit("peer", Direction.READ, whole)
        assert transport.wait(warm, DEADLINE_S) is TransferStatus.DONE, warm.error
        assert warm.seconds > 0.05, f"{BIG} bytes took {warm.seconds:.3f} s: too fast to stop mid-copy"
        not_after = time.monotonic() + warm.seconds / 4
        handle = transport.submit("peer", Direction.READ, whole, not_after=not_after)
        assert transport.wait(handle, DEADLINE_S) is TransferStatus.FAILED, "the copy outlived its deadline"
        assert "deadline passed during the copy" in handle.error
        assert handle.finished - not_after < 0.5
    finally:
        transport.close()
        peer.stop()
