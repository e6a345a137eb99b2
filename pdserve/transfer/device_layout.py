"""Where each block of a layer lives in a GPU attention backend's KV cache, and where a head's bytes are.

vLLM's CPU backend keeps a layer block-contiguous (layout.py's `LayerPlacement`). Its GPU
backends do not always: the FlashAttention layout of vLLM <= 0.11 is `[2, num_blocks, block_size,
num_kv_heads, head_size]` per layer, so a block is two runs (its K half and its V half, the V
half `num_blocks` blocks further on); vLLM >= 0.32 lays every backend's layer out as a logical
`[blocks, heads, tokens, content]` view (content = K then V of one token and head) in one of the
stride orders of `KVCacheLayout`, and a layout whose layer axis is not outermost interleaves the
layers' pages block by block.

`KvTensorLayout` describes one layer's KV tensor by its dims' roles, sizes and byte strides,
from a real tensor (`from_tensor`: exact for whatever the running vLLM chose) or from a
backend's shape and stride order (`from_stride_order`, `from_vllm_layout`, `legacy_backend_layout`).
From it, `blocks()` says where block b lives (`BlockRuns`: runs of equal length at fixed offsets
from the block's start) and how many bytes it has, and `head_blocks(h)` the same for head h's
bytes of each block; `head_contiguous` says whether those are one range per block (what moving
a slice of the heads, for different tensor-parallel sizes on the two sides, needs to be cheap).

Free of vLLM: a backend is read through the methods it has (`legacy_backend_layout`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pdserve.errors import ProtocolError
from pdserve.transport.base import CopyOp, RegionOps, merge_contiguous

BLOCK, KV, TOKEN, HEAD, CONTENT = "block", "kv", "token", "head", "content"
VLLM_VIEW_ROLES = (BLOCK, HEAD, TOKEN, CONTENT)  # vLLM >= 0.32's per-layer view [B, H, N, C]
LEGACY_ROLES = (TOKEN, HEAD, CONTENT)  # vLLM <= 0.11 shapes: [.., block_size, num_kv_heads, head_size]
MAX_RUNS = 1 << 16
_VLLM_LOGICAL = (0, 1, 2, 3, 4)  # [L, B, H, N, C] of vLLM's KVCacheLayout stride orders


@dataclass(frozen=True)
class BlockRuns:
    """Block b: `len(run_offsets)` runs of `run_bytes` bytes, run k at
    `offset + b * block_stride + run_offsets[k]` of region `region_id`."""

    region_id: int
    offset: int
    block_stride: int
    run_bytes: int
    run_offsets: tuple[int, ...]
    num_blocks: int

    @property
    def block_bytes(self) -> int:
        return self.run_bytes * len(self.run_offsets)

    @property
    def contiguous(self) -> bool:
        """Whether a block is one range of bytes."""
        return len(self.run_offsets) == 1

    def ranges(self, block: int) -> list[tuple[int, int]]:
        """(offset, length) of each run of `block` in its region."""
        start = self.offset + block * self.block_stride
        return [(start + run, self.run_bytes) for run in self.run_offsets]

    def copy_ops(self, peer: BlockRuns, pairs: Sequence[tuple[int, int]]) -> RegionOps:
        """The copies moving our block a to the peer's block b for each (a, b): run k to run k,
        merged where neighbours are contiguous on both sides. ProtocolError when the blocks are
        cut differently or a block id is out of range on its side."""
        if (self.run_bytes, len(self.run_offsets)) != (peer.run_bytes, len(peer.run_offsets)):
            raise ProtocolError(f"blocks differ: {len(self.run_offsets)} runs of {self.run_bytes} bytes here, "
                                f"{len(peer.run_offsets)} of {peer.run_bytes} on the peer")
        if self.region_id != peer.region_id:
            raise ProtocolError(f"the layer lives in region {self.region_id} here, {peer.region_id} on the peer")
        for a, b in pairs:
            if not (0 <= a < self.num_blocks and 0 <= b < peer.num_blocks):
                raise ProtocolError(f"block pair ({a}, {b}) out of range ({self.num_blocks} local, "
                                    f"{peer.num_blocks} remote blocks)")
        ops = (CopyOp(self.offset + a * self.block_stride + mine, peer.offset + b * peer.block_stride + theirs,
                      self.run_bytes)
               for mine, theirs in zip(self.run_offsets, peer.run_offsets) for a, b in pairs)
        return RegionOps(self.region_id, merge_contiguous(ops))


@dataclass(frozen=True)
class KvTensorLayout:
    """One layer's KV tensor: a role per dim (BLOCK once, any of KV, TOKEN, HEAD, CONTENT), its
    sizes and strides in bytes, and where element [0, ..., 0] sits in its region."""

    roles: tuple[str, ...]
    shape: tuple[int, ...]
    byte_strides: tuple[int, ...]
    elem_bytes: int
    region_id: int = 0
    offset: int = 0

    def __post_init__(self) -> None:
        if not (len(self.roles) == len(self.shape) == len(self.byte_strides)) or self.roles.count(BLOCK) != 1:
            raise ValueError(f"roles {self.roles} must name each of the {len(self.shape)} dims, BLOCK exactly once")

    @classmethod
    def from_tensor(cls, tensor, roles: Sequence[str], region_id: int = 0, region_base: int | None = None):
        """The layout of a real tensor (any strides); `region_base`: the address its region starts
        at (default: the tensor's storage)."""
        size = tensor.element_size()
        base = tensor.untyped_storage().data_ptr() if region_base is None else region_base
        return cls(tuple(roles), tuple(tensor.shape), tuple(s * size for s in tensor.stride()), size,
                   region_id, tensor.data_ptr() - base)

    @classmethod
    def from_stride_order(cls, shape: Sequence[int], stride_order: Sequence[int], roles: Sequence[str],
                          elem_bytes: int, region_id: int = 0, offset: int = 0):
        """A tensor allocated contiguous as `shape` permuted by `stride_order` (outermost first)
        and viewed back in logical order, as vLLM's backends allocate theirs."""
        strides = [0] * len(shape)
        stride = elem_bytes
        for dim in reversed(stride_order):
            strides[dim] = stride
            stride *= shape[dim]
        return cls(tuple(roles), tuple(shape), tuple(strides), elem_bytes, region_id, offset)

    @classmethod
    def from_vllm_layout(cls, stride_order: Sequence[int], num_layers: int, layer: int, num_blocks: int,
                         num_heads: int, block_size: int, content_bytes: int, region_id: int = 0):
        """Layer `layer` of `num_layers` sharing one buffer in a vLLM >= 0.32 `KVCacheLayout`
        (its `.value`, an order of [L, B, H, N, C]), unpadded pages, content in bytes."""
        whole = cls.from_stride_order((num_layers, num_blocks, num_heads, block_size, content_bytes), stride_order,
                                      ("layer", *VLLM_VIEW_ROLES), 1, region_id)
        return cls(VLLM_VIEW_ROLES, whole.shape[1:], whole.byte_strides[1:], 1, region_id,
                   layer * whole.byte_strides[0])

    @property
    def num_blocks(self) -> int:
        return self.shape[self.roles.index(BLOCK)]

    def blocks(self) -> BlockRuns:
        """Where each block's bytes are."""
        return self._runs(fixed={})

    def head_blocks(self, head: int) -> BlockRuns:
        """Where head `head`'s bytes of each block are."""
        if HEAD not in self.roles:
            raise ValueError(f"the layout {self.roles} has no head dim")
        return self._runs(fixed={self.roles.index(HEAD): head})

    @property
    def head_contiguous(self) -> bool:
        """Whether a head's bytes in a block are one contiguous range."""
        return self.head_blocks(0).contiguous

    def block_format(self) -> str:
        """The dims in memory order, outermost first, the block dim unsized ("block:head8:token16:
        content512:2B"): two peers copy blocks as bytes only when theirs are equal."""
        dims = sorted((stride, role, "" if role == BLOCK else size)
                      for role, size, stride in zip(self.roles, self.shape, self.byte_strides)
                      if role == BLOCK or size > 1)
        return ":".join(f"{role}{size}" for _, role, size in reversed(dims)) + f":{self.elem_bytes}B"

    def _runs(self, fixed: dict[int, int]) -> BlockRuns:
        block_dim = self.roles.index(BLOCK)
        offset = self.offset + sum(index * self.byte_strides[dim] for dim, index in fixed.items())
        dims = sorted((self.byte_strides[d], self.shape[d]) for d in range(len(self.shape))
                      if d != block_dim and d not in fixed and self.shape[d] > 1)
        run, inner = self.elem_bytes, 0
        while inner < len(dims) and dims[inner][0] == run:  # dims packed inside one another make one run
            run *= dims[inner][1]
            inner += 1
        offsets = [0]
        for stride, size in dims[inner:]:
            if len(offsets) * size > MAX_RUNS:
                raise ValueError(f"a block of {self.roles} {self.shape} is more than {MAX_RUNS} runs")
            offsets = [o + k * stride for o in offsets for k in range(size)]
        offsets.sort()
        if any(b - a < run for a, b in zip(offsets, offsets[1:])):
            raise ValueError(f"runs of {run} bytes overlap in {self.roles} {self.shape} {self.byte_strides}")
        return BlockRuns(self.region_id, offset, self.byte_strides[block_dim], run, tuple(offsets), self.num_blocks)


def legacy_backend_layout(backend_cls, num_blocks: int, block_size: int, num_kv_heads: int, head_size: int,
                          elem_bytes: int, region_id: int = 0, offset: int = 0) -> KvTensorLayout:
    """The layout of a backend with vLLM <= 0.11's `get_kv_cache_shape` (and optional
    `get_kv_cache_stride_order`): BLOCK where num_blocks is, KV where the 2 is, then token, head,
    content in the order those backends use."""
    shape = tuple(backend_cls.get_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size))
    try:
        order = tuple(backend_cls.get_kv_cache_stride_order())
    except (AttributeError, NotImplementedError):
        order = tuple(range(len(shape)))
    if num_blocks == 2:
        raise ValueError("with num_blocks 2 the block dim cannot be told from the K/V dim")
    roles: list[str] = []
    for size in shape[:2]:
        if size == num_blocks and BLOCK not in roles:
            roles.append(BLOCK)
        elif size == 2 and KV not in roles:
            roles.append(KV)
        else:
            break
    tail = len(shape) - len(roles)
    if BLOCK not in roles or not 0 < tail <= len(LEGACY_ROLES):
        raise ValueError(f"cannot tell the dims of KV cache shape {shape} ({num_blocks} blocks)")
    roles += LEGACY_ROLES[-tail:]
    return KvTensorLayout.from_stride_order(shape, order, roles, elem_bytes, region_id, offset)
