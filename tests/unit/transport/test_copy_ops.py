import pytest

from pdserve.errors import ProtocolError
from pdserve.transport import CopyOp, RegionDescriptor, block_copy_ops, merge_contiguous


def test_merge_coalesces_runs_contiguous_on_both_sides():
    ops = [CopyOp(0, 100, 10), CopyOp(10, 110, 10), CopyOp(20, 120, 5)]
    assert merge_contiguous(ops) == (CopyOp(0, 100, 25),)


def test_merge_sorts_by_local_offset_first():
    ops = [CopyOp(20, 120, 10), CopyOp(0, 100, 10), CopyOp(10, 110, 10)]
    assert merge_contiguous(ops) == (CopyOp(0, 100, 30),)


def test_merge_keeps_runs_apart_when_only_one_side_is_contiguous():
    local_only = [CopyOp(0, 100, 10), CopyOp(10, 300, 10)]
    remote_only = [CopyOp(0, 100, 10), CopyOp(50, 110, 10)]
    assert merge_contiguous(local_only) == tuple(local_only)
    assert merge_contiguous(remote_only) == tuple(remote_only)


def test_merge_drops_empty_ops_and_handles_empty_input():
    assert merge_contiguous([]) == ()
    assert merge_contiguous([CopyOp(0, 0, 0), CopyOp(5, 5, 1)]) == (CopyOp(5, 5, 1),)


def test_block_copy_ops_maps_block_ids_to_offsets_and_merges():
    ops = block_copy_ops([3, 4, 5, 9], [10, 11, 12, 2], block_bytes=64)
    assert ops == (CopyOp(3 * 64, 10 * 64, 3 * 64), CopyOp(9 * 64, 2 * 64, 64))


def test_block_copy_ops_with_stride_and_base_copies_only_block_bytes():
    ops = block_copy_ops([0, 1], [5, 6], block_bytes=16, block_stride=64, local_base=8, remote_base=4)
    assert ops == (CopyOp(8, 4 + 5 * 64, 16), CopyOp(8 + 64, 4 + 6 * 64, 16))


def test_block_copy_ops_rejects_length_mismatch():
    with pytest.raises(ValueError, match="differ in length"):
        block_copy_ops([1, 2], [1], 64)


def test_region_descriptor_wire_round_trip_and_rejection():
    desc = RegionDescriptor(3, 4096, "pdserve-1-x-kv0", 0x7F0000)
    assert RegionDescriptor.from_wire(desc.to_wire()) == desc
    with pytest.raises(ProtocolError, match="exactly the keys"):
        RegionDescriptor.from_wire({"region_id": 1, "size": 2})
    with pytest.raises(ProtocolError, match="region_id must be an integer"):
        RegionDescriptor.from_wire({"region_id": "1", "size": 2, "shm_name": None, "address": None})
