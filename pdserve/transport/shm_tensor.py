"""Move a CPU tensor's memory into a POSIX shm segment in place, so a peer process can map it.

vLLM (0.32) allocates the whole KV cache as one raw int8 buffer and hands out per-layer views
(`[num_blocks, num_kv_heads, block_size, 2*head_size]`, plus further kernel-block views bound to
the attention layers), often created under `torch.inference_mode()`. Re-pointing one view with
`Tensor.set_` would leave the raw buffer and every sibling view on the old memory. So we move the
*storage*: copy its bytes into a new segment, then swap the storage's data pointer with that of a
storage wrapping the segment (`UntypedStorage._swap_data_ptr_`, torch >= 2.5, private API). Every
tensor and view on that storage, inference tensors included, then reads and writes the segment.

Checked with torch 2.13 (see tests/unit/transport/test_shm_tensor.py):
- `_swap_data_ptr_` works on inference-mode storages, outside inference mode, and views follow.
- `Tensor.set_(storage, offset, size, stride)` on an inference tensor works only *inside*
  `torch.inference_mode()` (outside, or under `inference_mode(False)`, torch refuses an in-place
  update of an inference tensor), and moves only that one tensor object. It is the fallback when
  `_swap_data_ptr_` is missing.

Call it before other threads use the tensor (the connector does it in `register_kv_caches`).
torch is imported lazily: the rest of pdserve.transport does not need it.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, NamedTuple

from pdserve.errors import TransferError
from pdserve.transport.shared_segment import SharedSegment, segment_name

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)


class SharedTensorPlacement(NamedTuple):
    """Where a tensor's first element lives: `byte_offset` bytes into `segment`."""

    segment: SharedSegment
    byte_offset: int


def move_tensor_to_shared_memory(tensor: torch.Tensor, segment_name: str) -> SharedSegment:
    """Place the whole storage under `tensor` in a new segment named `segment_name`, in place.

    The segment covers the storage from its first byte; see `tensor_byte_offset` for where the
    tensor starts inside it. The segment's mapping stays alive as long as the storage uses it,
    even after `segment.close()` (which unlinks the name).
    """
    import torch  # lazy: heavy; this module imports without torch, only its tensor code needs it

    if tensor.device.type != "cpu":
        raise TransferError(f"only CPU tensors can move to shared memory, got {tensor.device}")
    storage = tensor.untyped_storage()
    nbytes = storage.nbytes()
    segment = SharedSegment.create(segment_name, nbytes)
    try:
        # torch.frombuffer keeps a reference to the object but not a buffer export; a memoryview
        # holds the export, so the mmap cannot be unmapped while the storage lives.
        shm_storage = torch.frombuffer(memoryview(segment.mmap), dtype=torch.uint8).untyped_storage()
        shm_storage.copy_(storage)
        if hasattr(storage, "_swap_data_ptr_"):
            storage._swap_data_ptr_(shm_storage)
        else:
            _set_in_place(tensor, shm_storage)
    except Exception:
        segment.close()
        raise
    return segment


def tensor_byte_offset(tensor: torch.Tensor, segment: SharedSegment) -> int:
    """Byte offset of `tensor`'s first element inside `segment`; raises if it is not inside."""
    offset = tensor.data_ptr() - segment.address
    if not 0 <= offset <= segment.size - tensor.numel() * tensor.element_size():
        raise TransferError(f"tensor at {tensor.data_ptr():#x} is not inside segment {segment!r}")
    return offset


def move_tensors_to_shared_memory(
    tensors: Mapping[str, torch.Tensor], token: str
) -> dict[str, SharedTensorPlacement]:
    """Move every distinct storage under `tensors` into its own segment (`segment_name(token,
    "kv<i>")`); tensors sharing a storage (vLLM's per-layer views of one buffer) share a segment."""
    by_storage: dict[int, SharedSegment] = {}
    placements: dict[str, SharedTensorPlacement] = {}
    try:
        for name, tensor in tensors.items():
            key = tensor.untyped_storage().data_ptr()
            segment = by_storage.get(key)
            if segment is None:
                segment = move_tensor_to_shared_memory(tensor, segment_name(token, f"kv{len(by_storage)}"))
                by_storage[tensor.untyped_storage().data_ptr()] = segment
            placements[name] = SharedTensorPlacement(segment, tensor_byte_offset(tensor, segment))
    except Exception:
        for segment in by_storage.values():
            segment.close()
        raise
    return placements


def _set_in_place(tensor: torch.Tensor, shm_storage) -> None:
    import torch  # lazy: heavy; this module imports without torch, only its tensor code needs it

    logger.warning("torch has no UntypedStorage._swap_data_ptr_: only this tensor object, not its views, moves")
    with torch.inference_mode(tensor.is_inference()):
        tensor.set_(shm_storage, tensor.storage_offset(), tensor.size(), tensor.stride())
