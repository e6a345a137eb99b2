"""KvLayout: block ids to byte copies (merged runs, range checks); peer fingerprint checks."""

from __future__ import annotations

import pytest

from pdserve.connector.layout import KvLayout, LayerPlacement, check_compatible
from pdserve.errors import IncompatiblePeerError, ProtocolError
from pdserve.transport.base import CopyOp, RegionOps

MINE = KvLayout((LayerPlacement(0, 0, 64, 8), LayerPlacement(0, 512, 64, 8)))
THEIRS = KvLayout((LayerPlacement(0, 192, 64, 10), LayerPlacement(0, 1024, 64, 10)))


def test_contiguous_pairs_merge_into_one_copy_per_run():
    [layer0] = MINE.layer_ops(THEIRS, [0], [(1, 4), (2, 5), (3, 6), (6, 0)])
    assert layer0 == RegionOps(0, (CopyOp(64, 192 + 4 * 64, 3 * 64), CopyOp(6 * 64, 192, 64)))


def test_runs_contiguous_on_one_side_only_stay_separate():
    [ops] = MINE.layer_ops(THEIRS, [0], [(1, 4), (2, 6)])
    assert len(ops.ops) == 2


def test_each_layer_uses_its_own_placement_and_region_in_layer_order():
    batch = MINE.layer_ops(THEIRS, {1, 0}, [(0, 1)])
    assert batch == [RegionOps(0, (CopyOp(0, 256, 64),)), RegionOps(0, (CopyOp(512, 1088, 64),))]
    assert [r.region_id for r in MINE.layer_ops(THEIRS, [0, 1], [(0, 1)])] == [0, 0]


@pytest.mark.parametrize("pair", [(8, 0), (0, 10), (100, 100)])
def test_out_of_range_blocks_are_rejected_naming_the_pair(pair):
    with pytest.raises(ProtocolError) as info:
        MINE.layer_ops(THEIRS, [0], [(0, 0), pair])
    assert str(pair) in str(info.value)


def test_no_pairs_means_no_bytes():
    assert all(not r.ops for r in MINE.layer_ops(THEIRS, [0, 1], []))


def test_wire_round_trip_and_rejects():
    assert KvLayout.from_wire(THEIRS.to_wire()) == THEIRS
    for bad in ["x", [[0, 1, 2]], [[0, 1, 2, -1]], [[0, 1, 2, "3"]]]:
        with pytest.raises(ProtocolError):
            KvLayout.from_wire(bad)


def test_check_compatible_names_every_differing_field():
    ours = {"dtype": "bfloat16", "block_size": 16, "cpu_isa": "AVX512", "model": "m"}
    theirs = {"dtype": "float16", "block_size": 32, "cpu_isa": "AVX512", "extra": 1, "model": "m"}
    with pytest.raises(IncompatiblePeerError) as info:
        check_compatible(ours, theirs, "127.0.0.1:6301")
    message = str(info.value)
    for field in ("dtype", "block_size", "extra", "127.0.0.1:6301", "bfloat16", "float16"):
        assert field in message
    assert "cpu_isa" not in message and "model" not in message


def test_check_compatible_accepts_equal_fingerprints():
    check_compatible({"a": 1, "b": [1, 2]}, {"b": [1, 2], "a": 1}, "peer")
