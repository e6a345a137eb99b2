"""Per-block digests of the KV a transfer moves: P's of what it sends, D's of what landed.

The digest of a transfer is one CRC-32 per entry of its flat block list (kv_groups.py: one run
per KV cache group), little-endian, 4 bytes each: for block position i, the CRC-32 of the CRCs of
that block's bytes in each layer of its group, in layer order. A block's bytes are what this side
moves of it: its heads' range under tensor-parallel slicing, only the state of a state block
(the layer's `BlockRuns`), so P's sub-transfer and D's agree byte for byte. P hashes a layer's
blocks when it submits the layer (WRITE, while the forward pass just wrote them) or when D's
`ReadDone` comes (READ, every block it holds: P does not know which D moved); D hashes the blocks
it received once P's word says they all landed and compares the positions it moved. A position
neither side moved reads 0.

CRC-32 (zlib, hardware-assisted where the build has it) because it is measured fast and in the
standard library; collisions matter only against accidental or stale bytes, never an adversary
(the control plane is authenticated), and a 32-bit check per block misses a corrupted block with
probability 2**-32. Memory is read in this process's address space: host KV, or the host mirror
of a GPU's KV (host staging). KV moved straight from GPU memory is not hashed here (config.py
refuses `kv_verify digest` there).
"""

from __future__ import annotations

import ctypes
import zlib
from collections.abc import Iterable, Sequence

import numpy as np

from pdserve.errors import TransferError
from pdserve.transfer.device_layout import BlockRuns
from pdserve.transfer.layout import NULL_BLOCK, KvLayout, LayerPlacement
from pdserve.transfer.ranks import Slicing
from pdserve.transport.base import RegionDescriptor

DIGEST_BYTES = 4  # per block position


class HostMemory:
    """This process's registered regions, read in place."""

    def __init__(self, descriptors: Iterable[RegionDescriptor]):
        self._regions = {d.region_id: d for d in descriptors}

    def view(self, region_id: int, offset: int, length: int) -> memoryview:
        region = self._regions.get(region_id)
        if region is None or not region.device.is_cpu or offset < 0 or offset + length > region.size:
            raise TransferError(f"cannot hash {length} bytes at {offset} of region {region_id}: not host memory "
                                "registered here")
        return memoryview((ctypes.c_char * length).from_address(region.address + offset)).cast("B")


def block_ranges(layer: LayerPlacement | BlockRuns, block: int, slicing: Slicing | None) -> list[tuple[int, int]]:
    """(offset, length) in the layer's region of what this side moves of `block`."""
    if isinstance(layer, BlockRuns):
        starts, run = [layer.offset + block * layer.block_stride + r for r in layer.run_offsets], layer.run_bytes
    else:
        starts, run = [layer.offset + block * layer.block_bytes], layer.block_bytes
    if slicing is None:
        return [(s, run) for s in starts]
    head_bytes = run // slicing.local_heads
    first, length = slicing.heads.first_local * head_bytes, slicing.heads.count * head_bytes
    return [(s + first, length) for s in starts]


def moved_positions(block_ids: Sequence[int], first_block: int, sparse: Sequence[bool],
                    decode_ids: Sequence[int] | None) -> list[list[int]]:
    """Per KV cache group, the positions of the flat block list whose block moves: from
    `first_block` on, skipping where D's block (`decode_ids`) is the null block in a sparse group
    (Transfer.group_pairs's rule). Without `decode_ids` (P READ: it does not know D's blocks)
    every position from `first_block` where our own block is not the null block."""
    n = len(block_ids) // len(sparse)
    out = []
    for g, skips in enumerate(sparse):
        names = block_ids if decode_ids is None else decode_ids
        out.append([i for i in range(g * n + first_block, (g + 1) * n) if not (skips and names[i] == NULL_BLOCK)])
    return out


class BlockDigests:
    """One transfer's per-layer CRCs on this side, folded into its digest once every layer is in."""

    def __init__(self, num_blocks: int, positions: list[list[int]]):
        self.positions = positions
        self._layers: dict[int, np.ndarray] = {}
        self._num_blocks = num_blocks

    def add_layers(self, layout: KvLayout, memory: HostMemory, layers: Iterable[int], block_ids: Sequence[int],
                   slicing: Slicing | None) -> None:
        """Hash `layers`' blocks (their positions in our group) as they are in memory now."""
        for index in layers:
            layer = layout.layers[index]
            crcs = np.zeros(self._num_blocks, dtype="<u4")
            for i in self.positions[layout.group_of(index)]:
                crc = 0
                for offset, length in block_ranges(layer, block_ids[i], slicing):
                    crc = zlib.crc32(memory.view(layer.region_id, offset, length), crc)
                crcs[i] = crc
            self._layers[index] = crcs

    def digest(self, layout: KvLayout) -> bytes:
        """The transfer's digest (module docstring); every layer must have been added."""
        out = np.zeros(self._num_blocks, dtype="<u4")
        for group, positions in enumerate(self.positions):
            layers = [i for i in range(len(layout.layers)) if layout.group_of(i) == group]
            if not positions or not layers:
                continue
            column = np.stack([self._layers[i][positions] for i in layers], axis=1)  # [position, layer]
            out[positions] = [zlib.crc32(row.tobytes()) for row in column]
        return out.tobytes()


def mismatched(ours: bytes, theirs: bytes, positions: list[list[int]]) -> list[int] | None:
    """Positions we moved whose digests differ; None when `theirs` is not a digest of this block list."""
    if len(theirs) != len(ours):
        return None
    a, b = np.frombuffer(ours, dtype="<u4"), np.frombuffer(theirs, dtype="<u4")
    moved = [i for group in positions for i in group]
    return [i for i in moved if a[i] != b[i]]
