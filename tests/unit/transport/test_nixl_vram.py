"""NIXL with device memory: a region's device picks its NIXL memory type (DRAM or VRAM and the
GPU's ordinal) for registration and for each side of a posted transfer. No GPU here: NIXL's
bindings and agent are stood in for; what reaches them is checked."""

from __future__ import annotations

import time

import pytest

from pdserve.transport import CopyOp, Direction, RegionDescriptor, RegionOps, TransferStatus
from pdserve.transport import nixl_agent as nixl_agent_module
from pdserve.transport.device import CPU, MemoryDevice
from pdserve.transport.nixl_agent import DRAM, NixlAgent, NixlMemory, XferState, nixl_memory

GPU1 = MemoryDevice("cuda", 1)


def test_host_memory_is_dram_and_a_gpu_s_is_vram_under_its_ordinal():
    assert nixl_memory(CPU) == DRAM == NixlMemory("DRAM", 0)
    assert nixl_memory(GPU1) == NixlMemory("VRAM", 1)
    assert nixl_memory(MemoryDevice.parse("cuda")) == NixlMemory("VRAM", 0)


class FakeBindings:
    """NIXL's bindings as far as NixlAgent uses them; records registrations."""

    DRAM_SEG, VRAM_SEG, NIXL_SUCCESS, NIXL_IN_PROG = "dram-seg", "vram-seg", 0, 1
    NIXL_THREAD_SYNC_NONE = 0
    registered: list = []

    class nixlAgentConfig:  # noqa: N801 - NIXL's name
        pass

    class nixlAgent:  # noqa: N801
        def __init__(self, name, config):
            pass

        def getAvailPlugins(self):  # noqa: N802
            return ["UCX"]

        def createBackend(self, name, params):  # noqa: N802
            pass

        def registerMem(self, descs):  # noqa: N802
            FakeBindings.registered.append(descs)
            return 0

    @staticmethod
    def nixlRegDList(segment, descs):  # noqa: N802
        return (segment, descs)


def test_the_agent_registers_a_gpu_region_as_vram_with_the_gpu_ordinal(monkeypatch):
    monkeypatch.setattr(nixl_agent_module, "load_bindings", lambda: FakeBindings)
    FakeBindings.registered = []
    agent = NixlAgent("a")
    agent.register(0x1000, 4096, nixl_memory(GPU1))
    agent.register(0x9000, 4096)
    assert FakeBindings.registered == [("vram-seg", [(0x1000, 4096, 1, "")]), ("dram-seg", [(0x9000, 4096, 0, "")])]


class FakeAgent:
    def __init__(self):
        self.registered, self.posted = [], []

    def register(self, address, size, memory):
        self.registered.append((address, memory))

    def add_remote(self, metadata):
        return "peer"

    def remove_remote(self, name):
        pass

    def post(self, write, local, remote, remote_name, local_segment="DRAM", remote_segment="DRAM"):
        self.posted.append((local, remote, local_segment, remote_segment))
        return len(self.posted), XferState.DONE

    def state(self, request):
        return XferState.DONE

    def release(self, request):
        pass

    def close(self):
        pass


@pytest.fixture
def transport():
    from pdserve.transport.nixl import NixlTransport

    agent = FakeAgent()
    transport = NixlTransport("local", agent=agent, copy_timeout_s=10)
    yield transport, agent
    transport.close()


def test_device_regions_register_as_vram_and_post_with_each_side_s_memory(transport):
    transport, agent = transport
    transport.register_region(0, 1 << 30, 1 << 20, device=GPU1)
    transport.register_region(1, 2 << 30, 1 << 20)
    assert agent.registered == [(1 << 30, NixlMemory("VRAM", 1)), (2 << 30, DRAM)]
    transport.attach_peer("peer", [RegionDescriptor(0, 1 << 20, None, 1 << 32, MemoryDevice("cuda", 0)),
                                   RegionDescriptor(1, 1 << 20, None, 1 << 33)], b"md")
    handle = transport.submit("peer", Direction.WRITE, [RegionOps(0, (CopyOp(0, 64, 128),))])
    assert transport.wait(handle, 10) is TransferStatus.DONE
    assert agent.posted[-1] == ([((1 << 30), 128, 1)], [((1 << 32) + 64, 128, 0)], "VRAM", "VRAM")
    handle = transport.submit("peer", Direction.READ, [RegionOps(1, (CopyOp(0, 0, 8),))])
    assert transport.wait(handle, 10) is TransferStatus.DONE and agent.posted[-1][2:] == ("DRAM", "DRAM")


def test_a_batch_over_host_and_device_memory_fails_before_posting(transport):
    transport, agent = transport
    transport.register_region(0, 1 << 30, 4096, device=GPU1)
    transport.register_region(1, 2 << 30, 4096)
    transport.attach_peer("peer", [RegionDescriptor(0, 4096, None, 1 << 32), RegionDescriptor(1, 4096, None, 1 << 33)],
                          b"md")
    batch = [RegionOps(0, (CopyOp(0, 0, 8),)), RegionOps(1, (CopyOp(0, 0, 8),))]
    handle = transport.submit("peer", Direction.WRITE, batch, not_after=time.monotonic() + 10)
    assert transport.wait(handle, 10) is TransferStatus.FAILED and "several memories" in handle.error
    assert agent.posted == []
