"""Data plane: move byte ranges between registered memory regions of two peers (no vLLM here)."""

from pdserve.transport.base import (
    CopyOp,
    Direction,
    RegionDescriptor,
    RegionOps,
    TransferHandle,
    TransferStatus,
    Transport,
    block_copy_ops,
    merge_contiguous,
)
from pdserve.transport.device import CPU, MemoryDevice
from pdserve.transport.shared_segment import SharedSegment, segment_name, sweep_stale_segments
from pdserve.transport.shm import ShmTransport

__all__ = [
    "CPU",
    "CopyOp",
    "Direction",
    "MemoryDevice",
    "RegionDescriptor",
    "RegionOps",
    "SharedSegment",
    "ShmTransport",
    "Transport",
    "TransferHandle",
    "TransferStatus",
    "block_copy_ops",
    "merge_contiguous",
    "segment_name",
    "sweep_stale_segments",
]
