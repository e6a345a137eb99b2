"""`CudaBackend`: the device calls of the GPU transports on a CUDA (or ROCm/HIP) GPU.

This is the only module of pdserve.transport that needs a GPU; it is kept to thin wrappers over
PyTorch so that every decision lives in code the CPU stand-in runs too. It is exercised by
scripts/gpu_check.py, not by the unit tests (which run on hosts without a GPU).

IPC goes through PyTorch's own sharing of CUDA storages (`UntypedStorage._share_cuda_` and
`_new_shared_cuda`, what torch.multiprocessing uses): the handle names the whole allocation
block and the storage's offset in it, so any storage of the caching allocator can be shared, and
the mapping in the peer ends when its last tensor is dropped (PyTorch then closes the handle).
"""

from __future__ import annotations

from contextlib import AbstractContextManager

from pdserve.errors import TransferError
from pdserve.transport.device import MemoryDevice
from pdserve.transport.device_backend import DeviceBackend, ExportedRegion, OpenedRegion
from pdserve.transport.ipc_handle import IpcHandle

NUM_SHARE_FIELDS = 8  # (device, handle, size, offset, ref counter handle, ref counter offset, event handle, sync)


class CudaBackend(DeviceBackend):
    """The GPU `index`. `ready_stream`: the stream the model computes on, when the thread that
    submits transfers may be another (default: the submitting thread's current stream)."""

    def __init__(self, index: int = 0, ready_stream=None):
        import torch  # lazy: heavy; this module imports without torch, only its tensor code needs it

        self._torch = torch
        self.device = MemoryDevice("cuda", index)
        self._torch_device = torch.device("cuda", index)
        self._ready_stream = ready_stream

    def export(self, tensor) -> ExportedRegion:
        torch = self._torch
        storage = tensor.untyped_storage()
        fields = tuple(storage._share_cuda_())
        data = torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(storage)
        return ExportedRegion(data, IpcHandle.for_this_process("cuda", fields))

    def open(self, ipc: IpcHandle, size: int) -> OpenedRegion:
        torch = self._torch
        if ipc.kind != "cuda" or len(ipc.fields) != NUM_SHARE_FIELDS:
            raise TransferError(f"not a CUDA IPC handle: kind {ipc.kind}, {len(ipc.fields)} fields")
        try:
            torch.cuda._lazy_init()
            storage = torch.UntypedStorage._new_shared_cuda(*ipc.fields)
        except Exception as e:  # noqa: BLE001 - torch raises RuntimeError and friends; map them here
            raise TransferError(f"cannot open the CUDA IPC handle of process {ipc.owner_pid}: "
                                f"{type(e).__name__}: {e}") from e
        if storage.nbytes() < size:
            raise TransferError(f"the CUDA IPC region of process {ipc.owner_pid} has {storage.nbytes()} bytes, "
                                f"need {size}")
        data = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
        return OpenedRegion(data, lambda: None)  # unmapped by PyTorch when `data` is dropped

    def record_ready(self):
        event = self._torch.cuda.Event()
        event.record(self._ready_stream or self._torch.cuda.current_stream(self._torch_device))
        return event

    def new_stream(self):
        return self._torch.cuda.Stream(device=self._torch_device)

    def on_stream(self, stream) -> AbstractContextManager:
        return self._torch.cuda.stream(stream)

    def record(self, stream):
        event = self._torch.cuda.Event()
        event.record(stream)
        return event

    def done(self, event) -> bool:
        return event.query()

    def pin(self, host) -> None:
        status = self._torch.cuda.cudart().cudaHostRegister(host.data_ptr(), host.numel() * host.element_size(), 0)
        if int(status) != 0:
            raise TransferError(f"cudaHostRegister of {host.numel() * host.element_size()} bytes failed: {status}")

    def unpin(self, host) -> None:
        self._torch.cuda.cudart().cudaHostUnregister(host.data_ptr())
