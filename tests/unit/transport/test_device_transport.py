"""Which transport moves device KV (policies, host staging), and how its storages become regions."""

from __future__ import annotations

import pytest
import torch

from pdserve.errors import ConfigError, TransferError
from pdserve.transport import ShmTransport
from pdserve.transport.cpu_backend import CpuStandIn
from pdserve.transport.device import MemoryDevice
from pdserve.transport.device_transport import build_device_transport, register_device_tensors
from pdserve.transport.gpu_ipc import GpuIpcTransport
from pdserve.transport.nixl_auto import PeerRoute, RoutedTransport
from pdserve.transport.staged import StagedTransport


def _build(policy: str, kv_buffer_device: str = "cuda"):
    return build_device_transport(policy, kv_buffer_device, CpuStandIn("b"), "agent", 5.0, "tok")


@pytest.mark.parametrize("policy, kv_buffer_device, words", [
    ("shm", "cuda", "transport shm moves host memory"),
    ("gpu-ipc", "cpu", "kv_buffer_device cpu stages"),
    ("auto", "xpu", "kv_buffer_device must be one of cpu, cuda"),
    ("rdma", "cuda", "unknown transport 'rdma'"),
])
def test_combinations_that_cannot_move_device_kv_are_refused_saying_why(policy, kv_buffer_device, words):
    with pytest.raises(ConfigError, match=words):
        _build(policy, kv_buffer_device)


def test_gpu_ipc_reaches_only_peers_proven_on_this_host():
    transport = _build("gpu-ipc")
    try:
        assert isinstance(transport, RoutedTransport) and isinstance(transport.shm, GpuIpcTransport)
        assert transport.choose(PeerRoute(True)) == "gpu-ipc" and transport.local_endpoint() == b""
        with pytest.raises(TransferError, match="on this host only.*no proof"):
            transport.choose(PeerRoute(False, b"md", "no proof"))
    finally:
        transport.close()


def test_host_staging_wraps_the_host_transports():
    transport = _build("shm", "cpu")
    try:
        assert isinstance(transport, StagedTransport) and transport.inner.policy == "shm"
        transport.register_tensor(0, torch.zeros(4096, dtype=torch.uint8))
        assert transport.local_descriptors()[0].device.is_cpu
    finally:
        transport.close()


class RecordingNixl(ShmTransport):
    """Stands in for NixlTransport: records what is registered, and with which device."""

    def __init__(self):
        super().__init__(name="fakenixl")
        self.registered = []

    def _register_memory(self, address, size, device):
        self.registered.append(device)

    def local_endpoint(self) -> bytes:
        return b"md"


def test_the_router_registers_device_storages_with_nixl_as_their_device():
    nixl = RecordingNixl()
    routed = RoutedTransport("nixl", GpuIpcTransport(CpuStandIn("r")), nixl, local_name="gpu-ipc")
    try:
        desc = routed.register_tensor(0, torch.zeros(64, dtype=torch.uint8))
        assert desc.ipc is not None and nixl.registered == [desc.device]
        with pytest.raises(TransferError, match="register_tensor"):
            routed.register_region(1, 1 << 30, 4096, device=MemoryDevice("cuda", 2))
    finally:
        routed.close()
    with RoutedTransport("shm", ShmTransport()) as host_only:
        with pytest.raises(TransferError, match="cannot share device memory"):
            host_only.register_tensor(0, torch.zeros(4))
        with pytest.raises(TransferError, match="host memory only"):
            host_only.register_region(0, 1 << 30, 4096, device=MemoryDevice("cuda", 0))


def test_each_storage_becomes_one_region_and_each_layer_its_offset_in_it():
    whole = torch.zeros(4, 2, 8, dtype=torch.float16)  # vLLM >= 0.32: layers sharing one buffer
    other = torch.zeros(2, 8, dtype=torch.float16)
    with GpuIpcTransport(CpuStandIn("layers")) as transport:
        placements = register_device_tensors({"l0": whole[0], "l1": whole[1], "l2": other, "l3": whole[3]}, transport)
        assert [tuple(p) for p in placements.values()] == [(0, 0), (0, 32), (1, 0), (0, 96)]
        assert [d.size for d in transport.local_descriptors()] == [128, 32]


def test_nixl_started_late_gets_the_device_storages_registered_before():
    started = []

    def start_nixl():
        started.append(RecordingNixl())
        return started[-1]

    routed = RoutedTransport("auto", GpuIpcTransport(CpuStandIn("late")), start_nixl=start_nixl, local_name="gpu-ipc")
    try:
        desc = routed.register_tensor(0, torch.zeros(64, dtype=torch.uint8))
        assert not started and routed.choose(PeerRoute(True)) == "gpu-ipc"
        assert routed.local_endpoint() == b"md" and len(started) == 1  # a peer not here asked: NIXL starts
        assert started[0].registered == [desc.device]
    finally:
        routed.close()
