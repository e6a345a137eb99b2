"""The transport for a KV cache that lives on a GPU, and how its storages become regions.

The worker calls `build_device_transport` instead of `build_transport` when vLLM's KV cache is on
a device (the connector reads `kv_buffer_device`, default the KV's own device):
- `kv_buffer_device: cpu` (host staging, staged.py): a pinned host mirror per storage, moved by
  the host transports of today under policy auto, shm or nixl; gpu-ipc makes no sense there.
- otherwise by policy: `gpu-ipc` (peers on this host, through IPC handles), `nixl` (every peer
  over NIXL, the KV registered as VRAM), `auto` (gpu-ipc for a peer proven on this host, NIXL
  otherwise); `shm` is refused: it moves host memory only.

`register_device_tensors` is the device counterpart of shm_tensor.move_tensors_to_shared_memory:
each distinct storage under vLLM's per-layer KV tensors becomes one region, and each layer's
placement says where in its region the layer's tensor starts (device_layout.py in the connector
then says where each block of it lives).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import NamedTuple

from pdserve.errors import ConfigError
from pdserve.transport.base import Transport
from pdserve.transport.cpu_backend import CpuStandIn
from pdserve.transport.cuda_backend import CudaBackend
from pdserve.transport.device import MemoryDevice
from pdserve.transport.device_backend import DeviceBackend
from pdserve.transport.gpu_ipc import GpuIpcTransport
from pdserve.transport.nixl_auto import POLICIES, build_transport
from pdserve.transport.shm import ShmTransport
from pdserve.transport.staged import StagedTransport

KV_BUFFER_DEVICES = ("cpu", "cuda")  # cuda: the KV's own device (no staging)


def backend_for(device: MemoryDevice, token: str, ready_stream=None) -> DeviceBackend:
    """The backend driving `device`: CUDA for a GPU; for the CPU, the stand-in that lets the GPU
    transports run on CPU tensors (tests and `gpu_check.py --device cpu`)."""
    if device.is_cpu:
        return CpuStandIn(token)
    return CudaBackend(device.index, ready_stream)


def build_device_transport(policy: str, kv_buffer_device: str, backend: DeviceBackend, agent_name: str,
                           copy_timeout_s: float, token: str,
                           prepare: Callable[[Transport], Transport] = lambda transport: transport) -> Transport:
    """The worker's transport for KV on `backend.device` (module docstring); ConfigError for a
    combination that cannot move it."""
    if policy not in POLICIES:
        raise ConfigError(f"unknown transport {policy!r} (available: {', '.join(POLICIES)})")
    if kv_buffer_device not in KV_BUFFER_DEVICES:
        raise ConfigError(f"kv_buffer_device must be one of {', '.join(KV_BUFFER_DEVICES)}, got {kv_buffer_device!r}")
    if kv_buffer_device == "cpu":
        if policy == "gpu-ipc":
            raise ConfigError("transport gpu-ipc moves device memory, but kv_buffer_device cpu stages the KV in "
                              "host memory: use transport auto, shm or nixl with it")
        inner = build_transport(policy, prepare(ShmTransport()), agent_name, copy_timeout_s, prepare)
        return StagedTransport(backend, inner, token)
    if policy == "shm":
        raise ConfigError(f"transport shm moves host memory, and the KV cache is on {backend.device}: use "
                          "transport gpu-ipc, auto or nixl, or kv_buffer_device cpu")
    return build_transport(policy, GpuIpcTransport(backend), agent_name, copy_timeout_s, prepare, local_name="gpu-ipc")


class DevicePlacement(NamedTuple):
    """Where a layer's KV tensor starts: `byte_offset` bytes into region `region_id`."""

    region_id: int
    byte_offset: int


def register_device_tensors(tensors: Mapping[str, object], transport) -> dict[str, DevicePlacement]:
    """Register every distinct storage under `tensors` (layer name -> KV tensor) with
    `transport.register_tensor`, as regions 0, 1, ... in order of first use; tensors sharing a
    storage share its region."""
    region_ids: dict[int, int] = {}  # storage address (after registering: the CPU stand-in moves it) -> region
    placements = {}
    for name, tensor in tensors.items():
        if tensor.untyped_storage().data_ptr() not in region_ids:
            region_id = len(region_ids)
            transport.register_tensor(region_id, tensor)
            region_ids[tensor.untyped_storage().data_ptr()] = region_id
        base = tensor.untyped_storage().data_ptr()
        placements[name] = DevicePlacement(region_ids[base], tensor.data_ptr() - base)
    return placements
