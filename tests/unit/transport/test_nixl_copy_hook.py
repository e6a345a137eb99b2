"""NixlTransport's copy hook: run after a READ into host memory landed and before its handle is
DONE, with the ranges it wrote here, so the fault plan's `corrupt_copy` (and the other copy rules)
reach NIXL reads too; a WRITE (the peer's memory) and a read into GPU memory get no hook. The
agent is a stand-in whose requests end when the test says."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest

from pdserve.faults.plan import FaultPlan
from pdserve.transport import CopyOp, Direction, RegionOps, TransferStatus
from pdserve.transport.device import CPU, MemoryDevice
from pdserve.transport.nixl import NixlTransport
from pdserve.transport.region_descriptor import RegionDescriptor
from tests.unit.transport.test_copy_deadline import FakeAgent

SIZE = 4096


@pytest.fixture
def nixl():
    agent = FakeAgent()
    transport = NixlTransport("local", agent=agent, copy_timeout_s=60, on_stuck_copy=lambda reason: None)
    memory = np.arange(SIZE, dtype=np.uint8)
    yield transport, agent, memory
    for request in agent.running:
        agent.end(request)
    transport.close()


def _attach(transport, memory, device=CPU):
    transport.register_region(0, memory.ctypes.data, SIZE, device=device)
    transport.attach_peer("peer", [RegionDescriptor(0, SIZE, None, 1 << 31, device)], b"metadata")


def _copy(transport, agent, direction) -> object:
    handle = transport.submit("peer", direction, [RegionOps(0, (CopyOp(64, 0, 128), CopyOp(1024, 512, 64)))])
    deadline = time.monotonic() + 5
    while not agent.running:
        assert time.monotonic() < deadline
        time.sleep(0.005)
    for request in list(agent.running):
        agent.end(request)
    assert handle.wait(5)
    return handle


@pytest.mark.parametrize("direction", [Direction.READ, Direction.WRITE])
def test_the_hook_sees_what_a_read_landed_here_and_nothing_of_a_write(nixl, direction):
    transport, agent, memory = nixl
    _attach(transport, memory)
    seen = []
    transport.set_copy_hook(lambda d, ranges: seen.append((d, ranges)))
    handle = _copy(transport, agent, direction)
    assert handle.status is TransferStatus.DONE
    base = memory.ctypes.data
    assert seen == ([(Direction.READ, [(base + 64, 128), (base + 1024, 64)])] if direction is Direction.READ else [])


def test_a_read_into_gpu_memory_gets_no_hook(nixl):
    transport, agent, _ = nixl
    transport.register_region(0, 1 << 30, SIZE, device=MemoryDevice("cuda", 0))
    transport.attach_peer("peer", [RegionDescriptor(0, SIZE, None, 1 << 31, MemoryDevice("cuda", 0))], b"metadata")
    seen = []
    transport.set_copy_hook(lambda d, ranges: seen.append(ranges))
    assert _copy(transport, agent, Direction.READ).status is TransferStatus.DONE
    assert seen == []


def test_a_hook_that_raises_fails_the_read(nixl):
    transport, agent, memory = nixl
    _attach(transport, memory)

    def fail(direction, ranges):
        raise RuntimeError("injected copy failure")

    transport.set_copy_hook(fail)
    handle = _copy(transport, agent, Direction.READ)
    assert handle.status is TransferStatus.FAILED and "injected copy failure" in handle.error


def test_the_fault_plan_corrupts_what_a_nixl_read_landed(nixl, tmp_path):
    transport, agent, memory = nixl
    _attach(transport, memory)
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(json.dumps({"rules": [{"action": "corrupt_copy"}]}))
    FaultPlan.load(str(plan_file), "D").install_copy_hook(transport)
    before = memory.copy()
    assert _copy(transport, agent, Direction.READ).status is TransferStatus.DONE
    changed = np.flatnonzero(memory != before)
    assert changed.size and set(changed) <= set(range(64, 192)) | set(range(1024, 1088))
