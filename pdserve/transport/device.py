"""`MemoryDevice`: where a region's bytes live, host memory or one accelerator.

A region is on the CPU (host memory: shm segments, pinned buffers) or on one device that PyTorch
calls `cuda:<index>`. ROCm GPUs are `cuda` devices in PyTorch too (HIP keeps the name), so `cuda`
here means "a GPU PyTorch drives through its CUDA/HIP API". On the wire a device is the string
PyTorch prints: `cpu`, `cuda:0`.
"""

from __future__ import annotations

import re
from typing import NamedTuple

from pdserve.errors import ProtocolError

KINDS = ("cpu", "cuda")
MAX_INDEX = 1023
_WIRE = re.compile(r"^(cpu|cuda)(?::(\d{1,4}))?\Z")


class MemoryDevice(NamedTuple):
    kind: str  # "cpu" or "cuda"
    index: int = 0  # the device ordinal; 0 for the CPU

    @property
    def is_cpu(self) -> bool:
        return self.kind == "cpu"

    def to_wire(self) -> str:
        return "cpu" if self.is_cpu else f"{self.kind}:{self.index}"

    def __str__(self) -> str:
        return self.to_wire()

    @classmethod
    def parse(cls, text) -> MemoryDevice:
        """`cpu`, `cuda` (index 0) or `cuda:<n>`; ProtocolError for anything else."""
        match = _WIRE.match(text) if isinstance(text, str) else None
        if match is None:
            raise ProtocolError(f"device must be 'cpu' or 'cuda:<n>', got {text!r:.40}")
        kind, index = match.group(1), int(match.group(2) or 0)
        if kind == "cpu" and index != 0:
            raise ProtocolError(f"device {text!r}: the CPU has no index but 0")
        if index > MAX_INDEX:
            raise ProtocolError(f"device {text!r}: index above {MAX_INDEX}")
        return cls(kind, index)

    @classmethod
    def of_tensor(cls, tensor) -> MemoryDevice:
        """The device a torch tensor lives on; ValueError for one neither on the CPU nor a GPU."""
        device = tensor.device
        if device.type == "cpu":
            return CPU
        if device.type == "cuda":
            return cls("cuda", device.index or 0)
        raise ValueError(f"tensors on {device} are not supported (only cpu and cuda)")


CPU = MemoryDevice("cpu", 0)
