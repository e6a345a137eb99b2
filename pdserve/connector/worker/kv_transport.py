"""`KvTransport`: the transport for where this worker's KV cache is, built once vLLM hands it over.

KV in host memory: the configured transport over shared memory, the KV moved into shared memory
in place. KV on a GPU: device_transport.py's, for the device the KV is on (known only then).
Either way the KV is registered with it (`KvMemory`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from pdserve.config import ConnectorConfig
from pdserve.connector.worker.kv_memory import KvMemory
from pdserve.rigs import Rig
from pdserve.transport.base import Transport
from pdserve.transport.device import MemoryDevice
from pdserve.transport.device_backend import DeviceBackend
from pdserve.transport.device_transport import backend_for, build_device_transport
from pdserve.transport.nixl_auto import build_transport
from pdserve.transport.shared_segment import sweep_stale_segments
from pdserve.transport.shm import ShmTransport

logger = logging.getLogger("pdserve.connector")


def kv_device_backend(tensor, token: str) -> DeviceBackend | None:
    """The backend driving the GPU a KV tensor is on; None for KV in host memory."""
    if tensor.device.type != "cuda":
        return None
    import torch  # lazy: heavy, and only KV on a GPU needs it

    return backend_for(MemoryDevice.of_tensor(tensor), token, torch.cuda.current_stream(tensor.device))


class KvTransport:
    def __init__(self, device_backend: Callable[[object, str], DeviceBackend | None], token: str,
                 local_heads: int | None):
        """`device_backend(tensor, token)`: the device backend for KV like `tensor`, None for host
        KV (tests stand CPU tensors in for a GPU's with CpuStandIn). `local_heads`: this rank's KV
        heads, when the model's fingerprint names them."""
        self._device_backend = device_backend
        self._token = token
        self._local_heads = local_heads
        self.backend: DeviceBackend | None = None  # KV on a GPU: what drives it
        self.transport: Transport | None = None  # built at `build`

    def build(self, kv_caches: dict, kv: KvMemory, config: ConnectorConfig, identity: str, rig: Rig) -> Transport:
        """Build the transport for `kv_caches` and register them with it (into `kv`)."""
        removed = sweep_stale_segments()
        if removed:
            logger.info("pdserve: removed %d shared-memory segments left by dead instances", len(removed))
        self.backend = self._device_backend(next(iter(kv_caches.values())), self._token)
        if self.backend is None:
            self.transport = build_transport(config.transport, rig.wrap_transport(ShmTransport()), identity,
                                             config.transfer_timeout, rig.wrap_transport)
            kv.register(kv_caches, self.transport, self._local_heads)
        else:
            self.transport = build_device_transport(
                config.transport, config.kv_buffer_device, self.backend, identity, config.transfer_timeout,
                self._token, rig.wrap_transport)
            kv.register_device(kv_caches, self.transport, self._local_heads)
        return self.transport

    def where(self) -> str:
        """Where the KV is, for the log."""
        if self.backend is None:
            return "in shared memory"
        return f"on {self.backend.device} ({type(self.transport).__name__})"

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()
        if self.backend is not None:
            self.backend.close()
