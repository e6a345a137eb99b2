"""No byte of a batch lands after its `not_after` deadline: the shared-memory copy stops between
chunks; a NIXL request (which cannot be stopped) keeps its handle PENDING until it ended, and one
still running after its drain counts as stuck (test_nixl_overdue.py runs real agents)."""

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
from pdserve.transport.device import CPU, MemoryDevice
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
    """A NIXL agent whose requests run until the test ends them (`end`); records what it released."""

    def __init__(self):
        self.running: dict[int, XferState] = {}
        self.released: list[int] = []
        self.removed: list[str] = []
        self.posted: list[tuple] = []

    def register(self, address, size, memory):
        pass

    def add_remote(self, metadata):
        return "peer"

    def remove_remote(self, name):
        self.removed.append(name)

    def post(self, write, local, remote, remote_name, local_segment="DRAM", remote_segment="DRAM"):
        self.posted.append((local_segment, remote_segment))
        request = len(self.posted)
        self.running[request] = XferState.IN_PROGRESS
        return request, XferState.IN_PROGRESS

    def state(self, request):
        return self.running[request]

    def end(self, request, state=XferState.DONE):
        self.running[request] = state

    def release(self, request):
        assert self.running[request] is not XferState.IN_PROGRESS, "a running request was released (nothing stops it)"
        self.released.append(request)

    def close(self):
        pass


@pytest.fixture
def fake_nixl():
    from pdserve.transport.nixl import NixlTransport

    agent, stuck = FakeAgent(), []
    transport = NixlTransport("local", agent=agent, copy_timeout_s=60, write_drain_s=0.2, read_drain_s=0.2,
                              on_stuck_copy=stuck.append)
    yield transport, agent, stuck
    for request in agent.running:
        agent.end(request)
    transport.close()


def _attach(transport, device=CPU):
    transport.register_region(0, 1 << 30, SIZE, device=device)
    transport.attach_peer("peer", [RegionDescriptor(0, SIZE, None, 1 << 31, device)], b"metadata")


def _wait_until(condition, timeout_s=DEADLINE_S):
    end = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < end, "condition not met in time"
        time.sleep(0.005)


@pytest.mark.parametrize("device", [CPU, MemoryDevice("cuda", 0)], ids=["DRAM", "VRAM"])
@pytest.mark.parametrize("direction", [Direction.WRITE, Direction.READ])
def test_nixl_request_running_past_its_deadline_keeps_its_handle_pending_until_it_ended(fake_nixl, direction, device):
    transport, agent, stuck = fake_nixl
    _attach(transport, device)
    not_after = time.monotonic() + 0.05
    handle = transport.submit("peer", direction, [RegionOps(0, (CopyOp(0, 0, SIZE),))], not_after=not_after)
    time.sleep(0.15)
    assert handle.status is TransferStatus.PENDING, "a copy still running was reported as ended"
    assert agent.released == [] and stuck == []
    ended = time.monotonic()
    agent.end(1)
    assert transport.wait(handle, DEADLINE_S) is TransferStatus.FAILED, "a copy ended past its deadline succeeded"
    assert "deadline passed during the copy" in handle.error and handle.finished >= ended
    assert agent.released == [1]


@pytest.mark.parametrize("direction", [Direction.WRITE, Direction.READ])
def test_nixl_request_still_running_after_its_drain_counts_as_stuck(fake_nixl, direction):
    transport, agent, stuck = fake_nixl
    _attach(transport)
    handle = transport.submit("peer", direction, [RegionOps(0, (CopyOp(0, 0, SIZE),))], not_after=time.monotonic() + 0.05)
    _wait_until(lambda: stuck)
    time.sleep(0.1)
    assert len(stuck) == 1 and direction.name in stuck[0] and "deadline passed" in stuck[0]  # the process would end here
    assert handle.status is TransferStatus.PENDING and agent.released == []
    agent.end(1, XferState.FAILED)
    assert transport.wait(handle, DEADLINE_S) is TransferStatus.FAILED and agent.released == [1]


def test_nixl_request_to_a_detached_peer_ends_before_its_agent_is_forgotten(fake_nixl):
    transport, agent, stuck = fake_nixl
    _attach(transport)
    handle = transport.submit("peer", Direction.READ, [RegionOps(0, (CopyOp(0, 0, SIZE),))])
    _wait_until(lambda: agent.posted)
    transport.detach_peer("peer")
    time.sleep(0.05)
    assert handle.status is TransferStatus.PENDING and agent.removed == []
    with pytest.raises(TransferError, match="still running"):
        transport.attach_peer("peer", [RegionDescriptor(0, SIZE, None, 1 << 31)], b"metadata")
    agent.end(1)
    assert transport.wait(handle, DEADLINE_S) is TransferStatus.FAILED and "detached" in handle.error
    _wait_until(lambda: agent.removed == ["peer"])
    transport.attach_peer("peer", [RegionDescriptor(0, SIZE, None, 1 << 31)], b"metadata")
