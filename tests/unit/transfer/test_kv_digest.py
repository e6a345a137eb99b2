"""kv_digest.py: which bytes of a block a side hashes (whole, a head slice, the runs of a state or
GPU layout), which positions it moved, and how two digests are compared."""

from __future__ import annotations

import zlib

import numpy as np

from pdserve.transfer.device_layout import BlockRuns
from pdserve.transfer.kv_digest import BlockDigests, HostMemory, block_ranges, mismatched, moved_positions
from pdserve.transfer.layout import KvLayout, LayerPlacement
from pdserve.transfer.ranks import HeadSlice, Slicing
from pdserve.transport.base import RegionDescriptor


def test_block_ranges_whole_sliced_and_in_runs():
    layer = LayerPlacement(0, 100, 64, 8)
    assert block_ranges(layer, 3, None) == [(100 + 3 * 64, 64)]
    # heads 1..2 of a block of 4 heads (16 bytes each)
    assert block_ranges(layer, 3, Slicing(HeadSlice(1, 0, 2), 4, 2)) == [(100 + 3 * 64 + 16, 32)]
    runs = BlockRuns(0, 0, 1000, 40, (0, 500), 8)
    assert block_ranges(runs, 2, None) == [(2000, 40), (2500, 40)]
    assert block_ranges(runs, 2, Slicing(HeadSlice(1, 0, 1), 2, 1)) == [(2020, 20), (2520, 20)]


def test_moved_positions_follow_first_block_and_skip_what_decode_does_not_need():
    blocks = (1, 2, 3, 0, 0, 5)
    assert moved_positions(blocks, 0, (False, True), blocks) == [[0, 1, 2], [5]]
    assert moved_positions(blocks, 2, (False, True), blocks) == [[2], [5]]
    assert moved_positions(blocks, 0, (False, True), (4, 5, 6, 0, 7, 8)) == [[0, 1, 2], [4, 5]]


def test_digest_changes_with_any_byte_and_mismatched_names_the_position():
    memory = np.random.default_rng(0).integers(0, 255, 2 * 4 * 64, dtype=np.uint8)
    region = RegionDescriptor(0, memory.nbytes, None, memory.ctypes.data)
    layout = KvLayout((LayerPlacement(0, 0, 64, 4), LayerPlacement(0, 256, 64, 4)))
    positions = [[0, 1, 2, 3]]

    def digest() -> bytes:
        d = BlockDigests(4, positions)
        d.add_layers(layout, HostMemory([region]), [1, 0], (0, 1, 2, 3), None)  # any order of layers
        return d.digest(layout)

    before = digest()
    per_layer = [zlib.crc32(memory[i * 256 + 64:i * 256 + 128].tobytes()) for i in range(2)]
    assert np.frombuffer(before, "<u4")[1] == zlib.crc32(np.array(per_layer, "<u4").tobytes())
    memory[256 + 2 * 64 + 5] ^= 1  # layer 1, block 2
    after = digest()
    assert mismatched(before, after, positions) == [2]
    assert mismatched(before, after, [[0, 1, 3]]) == []  # a position not moved is not compared
    assert mismatched(before, after[:-4], positions) is None
