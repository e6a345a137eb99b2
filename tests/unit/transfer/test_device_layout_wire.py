"""A layer placed as `BlockRuns` (KV on a GPU whose blocks are several runs) on the handshake's
wire, and the copies KvLayout makes of it; host placements keep their four-int wire form."""

from __future__ import annotations

import pytest

from pdserve.errors import ProtocolError
from pdserve.transfer.device_layout import BlockRuns
from pdserve.transfer.layout import KvLayout, LayerPlacement
from pdserve.transfer.ranks import HeadSlice, Slicing
from pdserve.transport.base import CopyOp, RegionOps

# K and V halves of each block, the V half 1000 bytes further on: [2, blocks, ...]
KV_HALVES = BlockRuns(region_id=0, offset=0, block_stride=100, run_bytes=100, run_offsets=(0, 1000), num_blocks=10)
HOST = LayerPlacement(region_id=1, offset=0, block_bytes=64, num_blocks=8)


def test_block_runs_and_host_placements_round_trip_and_keep_their_forms():
    layout = KvLayout((KV_HALVES, HOST))
    wire = layout.to_wire()
    assert wire[1] == [1, 0, 64, 8], "a host placement's wire form changed: old peers could not parse it"
    assert wire[0] == [0, 0, 100, 100, 10, 0, 1000]
    assert KvLayout.from_wire(wire, region_sizes={0: 2000, 1: 512}) == layout


@pytest.mark.parametrize("item, words", [
    ([0, 0, 100, 100, 10, 0, 50], "not ascending without overlap"),
    ([0, 0, 100, 0, 10, 0], "run_bytes 0 is outside"),
    ([0, -1, 100, 100, 10, 0], "offset -1 is outside"),
    ([0, 0, 100, 100, 10, "0"], "run offset must be an integer"),
    ([0, 0, 100, 100, 0, 0], "num_blocks 0 is outside"),
    ([0, 0, 100, 100, 10], "layer placement must be"),
])
def test_malformed_block_runs_are_refused_naming_the_field(item, words):
    with pytest.raises(ProtocolError, match="layer 0") as caught:
        KvLayout.from_wire([item])
    assert words in str(caught.value)


def test_block_runs_beyond_their_region_are_refused_and_interleaved_layers_are_not():
    with pytest.raises(ProtocolError, match="layer 0 ends at byte 2000, beyond its region 0"):
        KvLayout((KV_HALVES,)).check_fits({0: 1999})
    other_layer = BlockRuns(0, 50, 100, 50, (0,), 10)  # pages of two layers interleaved block by block
    mine = BlockRuns(0, 0, 100, 50, (0,), 10)
    KvLayout((mine, other_layer)).check_fits({0: 1000})


def test_runs_move_run_by_run_merged_where_contiguous():
    layout = KvLayout((KV_HALVES,))
    [ops] = layout.layer_ops(layout, [0], [[(1, 3), (2, 4), (7, 0)]])
    assert ops == RegionOps(0, (CopyOp(100, 300, 200), CopyOp(700, 0, 100), CopyOp(1100, 1300, 200),
                                CopyOp(1700, 1000, 100)))


def test_runs_cut_differently_or_out_of_range_are_refused():
    layout = KvLayout((KV_HALVES,))
    one_run = KvLayout((BlockRuns(0, 0, 200, 200, (0,), 10),))
    with pytest.raises(ProtocolError, match="layer 0: blocks differ"):
        layout.layer_ops(one_run, [0], [[(1, 1)]])
    with pytest.raises(ProtocolError, match=r"layer 0: block pair \(10, 0\) out of range"):
        layout.layer_ops(layout, [0], [[(10, 0)]])


def test_a_head_slice_moves_the_shared_heads_of_each_run():
    """Two heads per run here, one on the peer: the peer's head is our second."""
    mine = KvLayout((BlockRuns(0, 0, 100, 100, (0, 1000), 10),))
    theirs = KvLayout((BlockRuns(0, 0, 50, 50, (0, 500), 10),))
    slicing = Slicing(HeadSlice(first_local=1, first_peer=0, count=1), local_heads=2, peer_heads=1)
    [ops] = mine.layer_ops(theirs, [0], [[(2, 3)]], slicing)
    assert ops == RegionOps(0, (CopyOp(250, 150, 50), CopyOp(1250, 650, 50)))
    assert mine.bytes_moved([[(2, 3)]], slicing) == 100


def test_local_ops_cover_each_group_run_of_every_layer():
    layout = KvLayout((HOST, LayerPlacement(1, 512, 64, 8)), groups=(0, 1))
    ops = layout.local_ops([1, 2, 5, 6])  # group 0: blocks 1, 2; group 1: blocks 5, 6
    assert ops == [RegionOps(1, (CopyOp(64, 64, 128),)), RegionOps(1, (CopyOp(512 + 320, 512 + 320, 128),))]
