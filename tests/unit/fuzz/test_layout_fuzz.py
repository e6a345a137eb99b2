"""Fuzzing what a handshake reply tells us about the peer's memory: region descriptors, the layer
table, and the copies computed from it. Refused with ProtocolError or accepted within range; a
copy never leaves the layer it is meant for."""

from __future__ import annotations

import re

import pytest
from hypothesis import event, given
from hypothesis import strategies as st

from pdserve.errors import ProtocolError
from pdserve.transfer.layout import (
    MAX_BLOCK_BYTES,
    MAX_LAYERS,
    MAX_NUM_BLOCKS,
    MAX_OFFSET,
    MAX_REGION_ID,
    KvLayout,
    LayerPlacement,
)
from pdserve.transport.base import MAX_REGION_BYTES, RegionDescriptor
from tests.unit.fuzz.strategies import EDGE_INT, INT, TEXT, WIRE_VALUE, fuzz_settings

pytestmark = pytest.mark.timeout(120)

KEYS = ("region_id", "size", "shm_name", "address")
SHM_NAME = st.one_of(
    st.none(),
    TEXT,
    st.sampled_from(["pdserve-1-ab-kv0", "/proc/1/fd/3", "/proc/1/fd/3/", "pdserve-1-a/b", "pdserve-1-a\0", "/dev/shm/x"]),
    st.from_regex(r"\Apdserve-[0-9]{1,6}-[A-Za-z0-9_./-]{1,12}\Z"),
    st.from_regex(r"\A/proc/[0-9a-z]{1,6}/fd/[0-9]{1,4}\Z"),
)
FIELD_VALUE = {
    "region_id": st.one_of(INT, st.booleans(), WIRE_VALUE),
    "size": st.one_of(INT, st.booleans(), WIRE_VALUE),
    "shm_name": st.one_of(SHM_NAME, WIRE_VALUE),
    "address": st.one_of(st.none(), INT, st.booleans(), WIRE_VALUE),
}
PLAUSIBLE_DESCRIPTOR = st.fixed_dictionaries({
    "region_id": st.one_of(st.integers(-1, 4), EDGE_INT),
    "size": st.one_of(st.integers(0, 1 << 20), EDGE_INT),
    "shm_name": SHM_NAME,
    "address": st.one_of(st.none(), st.integers(-1, 1 << 20), EDGE_INT),
})
DESCRIPTOR = st.one_of(
    PLAUSIBLE_DESCRIPTOR,
    PLAUSIBLE_DESCRIPTOR,
    st.fixed_dictionaries({k: FIELD_VALUE[k] for k in KEYS}),
    st.fixed_dictionaries({k: FIELD_VALUE[k] for k in KEYS}, optional={"extra": WIRE_VALUE}),
    st.dictionaries(st.sampled_from(KEYS), INT, max_size=4),
    WIRE_VALUE,
)
_NAME_OK = re.compile(r"\A(pdserve-[0-9]+-[A-Za-z0-9_.-]+|/proc/[0-9]+/fd/[0-9]+)\Z")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@fuzz_settings(max_examples=1200)
@given(DESCRIPTOR)
def test_region_descriptors_are_refused_or_within_range(data):
    try:
        desc = RegionDescriptor.from_wire(data)
    except ProtocolError:
        event("refused")
        return
    event("accepted")
    assert _is_int(desc.region_id) and 0 <= desc.region_id <= MAX_REGION_ID
    assert _is_int(desc.size) and 0 < desc.size <= MAX_REGION_BYTES
    assert desc.address is None or (_is_int(desc.address) and 0 <= desc.address < 2**64)
    assert desc.shm_name is None or (_NAME_OK.match(desc.shm_name) and len(desc.shm_name) <= 255)


PLACEMENT_INT = st.one_of(st.integers(-2, 64), st.integers(0, 4096), EDGE_INT)
PLAUSIBLE_PLACEMENT = st.tuples(st.integers(-1, 2), st.integers(-1, 600), st.integers(0, 64), st.integers(0, 9)).map(list)
PLACEMENT = st.one_of(
    PLAUSIBLE_PLACEMENT,
    PLAUSIBLE_PLACEMENT,
    st.lists(PLACEMENT_INT, min_size=4, max_size=4),
    st.lists(st.one_of(PLACEMENT_INT, st.booleans(), WIRE_VALUE), min_size=3, max_size=5),
    WIRE_VALUE,
)


def _packed(layers: list[tuple[int, int, int]]) -> list[list[int]]:
    """Layers back to back in region 0, each `gap` bytes after the previous one (may be < 0)."""
    table, offset = [], 0
    for block_bytes, num_blocks, gap in layers:
        offset = max(0, offset + gap)
        table.append([0, offset, block_bytes, num_blocks])
        offset += block_bytes * num_blocks
    return table


PACKED_TABLE = st.lists(st.tuples(st.integers(1, 64), st.integers(1, 8), st.integers(-64, 16)), min_size=1, max_size=5).map(_packed)
LAYER_TABLE = st.one_of(
    PACKED_TABLE, st.lists(PLAUSIBLE_PLACEMENT, min_size=1, max_size=4), st.lists(PLACEMENT, max_size=8), WIRE_VALUE
)
REGION_SIZES = st.one_of(
    st.none(),
    st.fixed_dictionaries({0: st.integers(1, 2400)}),
    st.dictionaries(st.integers(0, 2), st.integers(1, 1200), max_size=3),
)


def _overlap(a: LayerPlacement, b: LayerPlacement) -> bool:
    return a.region_id == b.region_id and a.offset < b.end and b.offset < a.end and (a.offset, a.end) != (b.offset, b.end)


def _check_placement(layer: LayerPlacement) -> None:
    assert 0 <= layer.region_id <= MAX_REGION_ID and 0 <= layer.offset <= MAX_OFFSET
    assert 1 <= layer.block_bytes <= MAX_BLOCK_BYTES and 1 <= layer.num_blocks <= MAX_NUM_BLOCKS
    assert all(_is_int(v) for v in layer.to_wire())


@fuzz_settings(max_examples=1200)
@given(LAYER_TABLE, REGION_SIZES)
def test_layer_tables_are_refused_or_within_range_and_inside_their_regions(data, region_sizes):
    try:
        layout = KvLayout.from_wire(data, region_sizes=region_sizes)
    except ProtocolError:
        event("refused")
        return
    event("accepted" if region_sizes is None else "accepted, checked against regions")
    assert 0 < len(layout.layers) <= MAX_LAYERS
    for layer in layout.layers:
        _check_placement(layer)
    if region_sizes is not None:
        for i, layer in enumerate(layout.layers):
            assert layer.end <= region_sizes[layer.region_id]
            assert not any(_overlap(layer, other) for other in layout.layers[i + 1:])


def _layout(draw_layers):
    return KvLayout(tuple(LayerPlacement(*layer) for layer in draw_layers))


LAYER = st.tuples(st.just(0), st.integers(0, 4096), st.sampled_from([16, 64]), st.integers(1, 12))
BLOCK_ID = st.one_of(st.integers(-3, 14), st.booleans(), st.sampled_from([-(2**63), 2**40]))


@fuzz_settings(max_examples=1200)
@given(
    st.lists(LAYER, min_size=1, max_size=3),
    st.lists(LAYER, min_size=1, max_size=3),
    st.lists(st.integers(-1, 3), max_size=3),
    st.lists(st.tuples(BLOCK_ID, BLOCK_ID), max_size=6),
)
def test_copies_never_leave_the_layer_they_are_for(mine_layers, their_layers, layers, pairs):
    """Block -1 of layer 1 would be the last block of layer 0: every copy must stay inside the
    placement of its own layer, on both sides, or the batch is refused."""
    mine, theirs = _layout(mine_layers), _layout(their_layers)
    try:
        batch = mine.layer_ops(theirs, layers, [pairs])
    except ProtocolError:
        event("refused")
        return
    event("accepted")
    assert len(batch) == len(layers)
    for index, region_ops in zip(sorted(layers), batch):
        local, remote = mine.layers[index], theirs.layers[index]
        for op in region_ops.ops:
            assert local.offset <= op.local_offset and op.local_offset + op.length <= local.end
            assert remote.offset <= op.remote_offset and op.remote_offset + op.length <= remote.end
