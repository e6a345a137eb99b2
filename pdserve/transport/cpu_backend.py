"""`CpuStandIn`: the GPU transports' device calls with CPU tensors standing in for device memory.

What it keeps of a GPU: the region is exported in place (its storage moves into a shm segment, as
shm_tensor.py does for the KV cache) and another process maps it by a handle bound to our
incarnation; copies are the same torch ops on the same byte views. What it does not have: streams
(copies run at once on the copy thread) and events (complete when recorded). Unit tests that need
events still pending use a fake backend of their own; the real ones are scripts/gpu_check.py's.
"""

from __future__ import annotations

import itertools
import os
from contextlib import AbstractContextManager, nullcontext

from pdserve.errors import TransferError
from pdserve.transport.device import CPU
from pdserve.transport.device_backend import DeviceBackend, ExportedRegion, OpenedRegion
from pdserve.transport.ipc_handle import IpcHandle
from pdserve.transport.shared_segment import SharedSegment, segment_name
from pdserve.transport.shm_tensor import move_tensor_to_shared_memory


class _Complete:
    """An event of a synchronous stream: complete when recorded."""

    def query(self) -> bool:
        return True


class CpuStandIn(DeviceBackend):
    """See the module docstring. `token` names this process's segments ([A-Za-z0-9_.]+)."""

    def __init__(self, token: str = "dev"):
        self.device = CPU
        self._token = token
        self._count = itertools.count()
        self._segments: list[SharedSegment] = []  # ours: kept open (named by fd) for our lifetime

    def export(self, tensor) -> ExportedRegion:
        import torch  # lazy: heavy; this module imports without torch, only its tensor code needs it

        storage = tensor.untyped_storage()
        segment = move_tensor_to_shared_memory(tensor, segment_name(self._token, f"dev{os.getpid()}x{next(self._count)}"))
        path = segment.unlink_name()
        self._segments.append(segment)
        data = torch.empty(0, dtype=torch.uint8).set_(storage)
        return ExportedRegion(data, IpcHandle.for_this_process("shm", (path, segment.size)))

    def open(self, ipc: IpcHandle, size: int) -> OpenedRegion:
        import torch  # lazy: heavy; this module imports without torch, only its tensor code needs it

        if ipc.kind != "shm" or len(ipc.fields) != 2 or not isinstance(ipc.fields[0], str):
            raise TransferError(f"not a shm stand-in handle: kind {ipc.kind}, fields {ipc.fields!r:.80}")
        segment = SharedSegment.attach(ipc.fields[0], size)
        data = torch.frombuffer(memoryview(segment.mmap), dtype=torch.uint8)
        return OpenedRegion(data, lambda: segment.close(unlink=False))

    def record_ready(self):
        return _Complete()

    def new_stream(self):
        return None

    def on_stream(self, stream) -> AbstractContextManager:
        return nullcontext()

    def record(self, stream):
        return _Complete()

    def done(self, event) -> bool:
        return event.query()

    def pin(self, host) -> None:
        pass  # host memory stays where it is: there is no device to DMA to

    def unpin(self, host) -> None:
        pass

    def close(self) -> None:
        """Close our exported segments' names (their memory lives while the tensors do)."""
        for segment in self._segments:
            segment.close()
        self._segments = []
