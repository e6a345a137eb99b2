"""KvLayout: block ids to byte copies (merged runs, range checks); peer fingerprint checks."""

from __future__ import annotations

import pytest

from pdserve.errors import ProtocolError
from pdserve.transfer.layout import KvLayout, LayerPlacement
from pdserve.transport.base import CopyOp, RegionOps

MINE = KvLayout((LayerPlacement(0, 0, 64, 8), LayerPlacement(0, 512, 64, 8)))
THEIRS = KvLayout((LayerPlacement(0, 192, 64, 10), LayerPlacement(0, 1024, 64, 10)))


def test_contiguous_pairs_merge_into_one_copy_per_run():
    [layer0] = MINE.layer_ops(THEIRS, [0], [[(1, 4), (2, 5), (3, 6), (6, 0)]])
    assert layer0 == RegionOps(0, (CopyOp(64, 192 + 4 * 64, 3 * 64), CopyOp(6 * 64, 192, 64)))


def test_runs_contiguous_on_one_side_only_stay_separate():
    [ops] = MINE.layer_ops(THEIRS, [0], [[(1, 4), (2, 6)]])
    assert len(ops.ops) == 2


def test_each_layer_uses_its_own_placement_and_region_in_layer_order():
    batch = MINE.layer_ops(THEIRS, {1, 0}, [[(0, 1)]])
    assert batch == [RegionOps(0, (CopyOp(0, 256, 64),)), RegionOps(0, (CopyOp(512, 1088, 64),))]
    assert [r.region_id for r in MINE.layer_ops(THEIRS, [0, 1], [[(0, 1)]])] == [0, 0]


@pytest.mark.parametrize("pair", [(8, 0), (0, 10), (100, 100)])
def test_out_of_range_blocks_are_rejected_naming_the_pair(pair):
    with pytest.raises(ProtocolError) as info:
        MINE.layer_ops(THEIRS, [0], [[(0, 0), pair]])
    assert str(pair) in str(info.value)


def test_no_pairs_means_no_bytes():
    assert all(not r.ops for r in MINE.layer_ops(THEIRS, [0, 1], [[]]))


def test_wire_round_trip_and_rejects():
    assert KvLayout.from_wire(THEIRS.to_wire()) == THEIRS
    for bad in ["x", [[0, 1, 2]], [[0, 1, 2, -1]], [[0, 1, 2, "3"]]]:
        with pytest.raises(ProtocolError):
            KvLayout.from_wire(bad)


@pytest.mark.parametrize("pair", [(-1, 0), (0, -1), (True, 0), (0, 1.0)])
def test_negative_or_non_integer_block_ids_are_rejected(pair):
    """Block -1 of layer 1 is the last block of layer 0: a lower bound matters as much as an upper."""
    with pytest.raises(ProtocolError) as info:
        MINE.layer_ops(THEIRS, [1], [[(0, 0), pair]])
    assert "block pair" in str(info.value)


def test_layer_indexes_either_side_lacks_are_rejected():
    with pytest.raises(ProtocolError, match="layer 2 out of range"):
        MINE.layer_ops(THEIRS, [2], [[(0, 0)]])
    with pytest.raises(ProtocolError, match="layer -1 out of range"):
        MINE.layer_ops(THEIRS, [-1], [[(0, 0)]])


def test_layers_with_different_block_sizes_are_rejected():
    peer = KvLayout((LayerPlacement(0, 0, 32, 8), LayerPlacement(0, 512, 64, 8)))
    with pytest.raises(ProtocolError, match="layer 0 has 64-byte blocks here, 32 on the peer"):
        MINE.layer_ops(peer, [0], [[(0, 0)]])


@pytest.mark.parametrize(
    "placement, field",
    [
        ([-1, 0, 64, 8], "region_id"),
        ([0, -64, 64, 8], "offset"),
        ([0, 0, 0, 8], "block_bytes"),
        ([0, 0, 64, 0], "num_blocks"),
        ([True, 0, 64, 8], "region_id"),
        ([0, 0, 64, False], "num_blocks"),
        ([0, 1 << 60, 64, 8], "offset"),
        ([0, 0, 1 << 40, 8], "block_bytes"),
        ([0, 0, 64, 1 << 40], "num_blocks"),
        ([1 << 20, 0, 64, 8], "region_id"),
        ([0, 0.0, 64, 8], "offset"),
    ],
)
def test_out_of_range_placements_are_rejected_naming_the_field(placement, field):
    with pytest.raises(ProtocolError) as info:
        KvLayout.from_wire([[0, 0, 64, 8], placement])
    assert field in str(info.value) and "layer 1" in str(info.value)
    with pytest.raises(ProtocolError, match=field):
        LayerPlacement(*placement)


@pytest.mark.parametrize("data", [[], [[0, 0, 64, 8]] * 5000, [[0, 0, 64, 8, 9]], [(0, 0, 64, 8)], {"0": [0, 0, 64, 8]}])
def test_layer_tables_of_the_wrong_shape_or_size_are_rejected(data):
    with pytest.raises(ProtocolError):
        KvLayout.from_wire(data)


def test_layers_must_lie_inside_an_existing_region():
    wire = THEIRS.to_wire()  # layers end at bytes 832 and 1664 of region 0
    assert KvLayout.from_wire(wire, region_sizes={0: 1664}) == THEIRS
    with pytest.raises(ProtocolError, match="layer 1 ends at byte 1664, beyond its region 0 \\(1663 bytes\\)"):
        KvLayout.from_wire(wire, region_sizes={0: 1663})
    with pytest.raises(ProtocolError, match="layer 0 is in region 0, which the peer does not have"):
        KvLayout.from_wire(wire, region_sizes={1: 1 << 20})


def test_partly_overlapping_layers_are_rejected_but_aliased_ones_are_not():
    overlapping = [[0, 0, 64, 8], [0, 448, 64, 8]]  # layer 0 ends at 512
    with pytest.raises(ProtocolError, match="layers 0 and 1 overlap in region 0"):
        KvLayout.from_wire(overlapping, region_sizes={0: 4096})
    aliased = [[0, 0, 64, 8], [0, 0, 64, 8], [1, 0, 64, 8]]  # layers sharing one KV tensor
    assert len(KvLayout.from_wire(aliased, region_sizes={0: 512, 1: 512}).layers) == 3
