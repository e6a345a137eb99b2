"""`DeviceBackend`: the few device calls the GPU transports make, behind one seam.

Everything else in gpu_ipc.py, staged.py and device_copy.py is plain Python over torch tensors,
and runs the same with CPU tensors standing in for device memory (`CpuStandIn`, cpu_backend.py:
synchronous "streams", events that are complete when recorded, shm segments for IPC). The CUDA
implementation (cuda_backend.py) is the only code that needs a GPU; scripts/gpu_check.py runs it.

What a backend does:
- export a local tensor's storage so a process on this host can map it (`export`), and map
  a peer's (`open`); both bound to the exporting process's incarnation (ipc_handle.py);
- record events: `record_ready` on the stream that computes the KV (the stream the submitting
  thread is on, unless the backend was given one), `record` on the transport's side stream;
  `done` polls an event without blocking;
- run copies on a side stream (`new_stream`, `on_stream`: a context in which torch ops are
  enqueued on that stream);
- pin and unpin host memory for the staging buffers (`pin`, `unpin`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, NamedTuple

from pdserve.transport.device import MemoryDevice
from pdserve.transport.ipc_handle import IpcHandle

if TYPE_CHECKING:
    import torch


class ExportedRegion(NamedTuple):
    """A local storage, seen as bytes (`data`: a 1-D uint8 tensor over all of it), and the handle
    that lets a same-host process map it."""

    data: torch.Tensor
    ipc: IpcHandle


class OpenedRegion(NamedTuple):
    """A peer's region mapped here: its bytes as a 1-D uint8 tensor, and how to unmap it (once
    nothing uses `data` any more; after `close` the tensor must not be touched)."""

    data: torch.Tensor
    close: Callable[[], None]


class DeviceBackend(ABC):
    """See the module docstring. One backend drives one device; the transport calls `record_ready`
    on the submitting thread and everything else on its copy thread."""

    device: MemoryDevice

    @abstractmethod
    def export(self, tensor: torch.Tensor) -> ExportedRegion:
        """Share the whole storage under `tensor` with processes on this host."""

    @abstractmethod
    def open(self, ipc: IpcHandle, size: int) -> OpenedRegion:
        """Map a peer's exported region of `size` bytes; TransferError saying why it cannot."""

    @abstractmethod
    def record_ready(self) -> object:
        """An event on the compute stream, recorded now: work enqueued there so far (the KV of
        the layers computed) is complete once it is."""

    @abstractmethod
    def new_stream(self) -> object:
        """A side stream for the transport's copies."""

    @abstractmethod
    def on_stream(self, stream: object) -> AbstractContextManager:
        """A context in which torch ops are enqueued on `stream`."""

    @abstractmethod
    def record(self, stream: object) -> object:
        """An event recorded now on `stream`."""

    @abstractmethod
    def done(self, event: object) -> bool:
        """Whether everything before `event` on its stream has completed; never blocks."""

    @abstractmethod
    def pin(self, host: torch.Tensor) -> None:
        """Page-lock a host buffer so copies to and from the device are DMA (staging buffers)."""

    @abstractmethod
    def unpin(self, host: torch.Tensor) -> None:
        """Undo `pin`."""

    def close(self) -> None:  # noqa: B027 - a backend that holds nothing of its own (CUDA) has nothing to do
        """Release what the backend itself holds, once the transports using it are closed."""
