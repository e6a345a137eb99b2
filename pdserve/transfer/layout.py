"""Where each attention layer's KV blocks live, and the fingerprint two peers must share.

vLLM's CPU backend keeps one tensor per attention layer, `[num_blocks, num_kv_heads,
block_size, 2*head_size]`, block-contiguous, and packs the bytes of each head inside a block
ISA-specifically (AMX tiles), so blocks (or, between ranks of different tensor-parallel sizes,
each block's range of shared heads) move as opaque bytes and both sides must agree on dtype, block
size, per-head layout and ISA. That agreement is the fingerprint, checked in the handshake (the worker's handshake.py).

KV on a GPU (device_layout.py) is placed the same way when each block is one range of bytes, and
as a `BlockRuns` (several runs per block, `block_stride` apart) otherwise; only the latter has
its own form on the wire, so a host KV's layer table reads as it always did.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from pdserve.errors import ProtocolError
from pdserve.transfer.device_layout import MAX_RUNS, BlockRuns
from pdserve.transfer.ranks import Slicing
from pdserve.transport.base import CopyOp, RegionOps, merge_contiguous

NULL_BLOCK = 0  # vLLM's null block: where a sliding-window group holds no block
MAX_LAYERS = 4096
MAX_REGION_ID = (1 << 16) - 1
MAX_OFFSET = 1 << 48  # bytes: far beyond any KV cache, far below int64 overflow
MAX_BLOCK_BYTES = 1 << 32
MAX_NUM_BLOCKS = 1 << 32
RUNS_HEADER = 5  # ints before a BlockRuns' run offsets on the wire


def _check_int(value, name: str, low: int, high: int, where: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ProtocolError(f"{where}: {name} must be an integer, got {type(value).__name__} {value!r:.40}")
    if not low <= value <= high:
        raise ProtocolError(f"{where}: {name} {value} is outside {low}..{high}")


@dataclass(frozen=True)
class LayerPlacement:
    """Where one attention layer's blocks live: block b at `offset + b * block_bytes` of region
    `region_id`. Constructing one out of range raises ProtocolError naming the field."""

    region_id: int  # the shared-memory region holding this layer
    offset: int  # byte offset of block 0 inside the region
    block_bytes: int
    num_blocks: int

    def __post_init__(self) -> None:
        _check_int(self.region_id, "region_id", 0, MAX_REGION_ID, "layer placement")
        _check_int(self.offset, "offset", 0, MAX_OFFSET, "layer placement")
        _check_int(self.block_bytes, "block_bytes", 1, MAX_BLOCK_BYTES, "layer placement")
        _check_int(self.num_blocks, "num_blocks", 1, MAX_NUM_BLOCKS, "layer placement")

    @property
    def end(self) -> int:
        """One past the layer's last byte in its region."""
        return self.offset + self.block_bytes * self.num_blocks

    def to_wire(self) -> list[int]:
        return [self.region_id, self.offset, self.block_bytes, self.num_blocks]

    @classmethod
    def from_wire(cls, data) -> LayerPlacement:
        if not (isinstance(data, list) and len(data) == 4):
            raise ProtocolError(f"layer placement must be [region_id, offset, block_bytes, num_blocks], got {data!r:.100}")
        return cls(*data)


def runs_to_wire(runs: BlockRuns) -> list[int]:
    """[region_id, offset, block_stride, run_bytes, num_blocks, *run_offsets]: six ints or more,
    never the four of a `LayerPlacement`."""
    return [runs.region_id, runs.offset, runs.block_stride, runs.run_bytes, runs.num_blocks, *runs.run_offsets]


def runs_from_wire(data) -> BlockRuns:
    """A peer's `BlockRuns`; ProtocolError naming the field out of range, or runs that overlap."""
    if not (isinstance(data, list) and RUNS_HEADER < len(data) <= RUNS_HEADER + MAX_RUNS):
        raise ProtocolError(f"block runs must be [region_id, offset, block_stride, run_bytes, num_blocks, "
                            f"*run_offsets] with 1..{MAX_RUNS} runs, got {data!r:.100}")
    region_id, offset, block_stride, run_bytes, num_blocks = data[:RUNS_HEADER]
    run_offsets = data[RUNS_HEADER:]
    where = "block runs"
    _check_int(region_id, "region_id", 0, MAX_REGION_ID, where)
    _check_int(offset, "offset", 0, MAX_OFFSET, where)
    _check_int(block_stride, "block_stride", 1, MAX_OFFSET, where)
    _check_int(run_bytes, "run_bytes", 1, MAX_BLOCK_BYTES, where)
    _check_int(num_blocks, "num_blocks", 1, MAX_NUM_BLOCKS, where)
    for run in run_offsets:
        _check_int(run, "run offset", 0, MAX_OFFSET, where)
    if any(b - a < run_bytes for a, b in zip(run_offsets, run_offsets[1:])):
        raise ProtocolError(f"{where}: runs of {run_bytes} bytes at {run_offsets[:8]} are not ascending "
                            "without overlap")
    return BlockRuns(region_id, offset, block_stride, run_bytes, tuple(run_offsets), num_blocks)


def runs_end(runs: BlockRuns) -> int:
    """One past the last byte of the layer's last block in its region."""
    return runs.offset + (runs.num_blocks - 1) * runs.block_stride + runs.run_offsets[-1] + runs.run_bytes


Placement = LayerPlacement | BlockRuns


@dataclass(frozen=True)
class KvLayout:
    layers: tuple[Placement, ...]  # in model order; index = layer index
    groups: tuple[int, ...] = ()  # the KV cache group of each layer (vLLM's hybrid KV cache manager); () = all 0
    sparse: tuple[bool, ...] = ()  # per group: its runs may hold the null block, where nothing moves (kv_groups.py)

    def group_of(self, index: int) -> int:
        return self.groups[index] if self.groups else 0

    @property
    def num_groups(self) -> int:
        return max(self.groups, default=0) + 1

    @property
    def group_sparse(self) -> tuple[bool, ...]:
        return self.sparse or (False,) * self.num_groups

    def bytes_moved(self, pairs: Sequence[list[tuple[int, int]]], slicing: Slicing | None = None) -> int:
        """Bytes `layer_ops` with these pairs copies over every layer."""
        total = sum(layer.block_bytes * len(pairs[self.group_of(i)]) for i, layer in enumerate(self.layers))
        return total if slicing is None else total * slicing.heads.count // slicing.local_heads

    def layer_ops(self, peer: KvLayout, layers, pairs: Sequence[list[tuple[int, int]]],
                  slicing: Slicing | None = None) -> list[RegionOps]:
        """Copy lists for `layers`, moving local block a to peer block b for each (a, b) pair of
        the layer's KV cache group (`pairs[group]`).

        With `slicing` (the two ranks hold different heads, ranks.py) only the shared heads' byte
        range of each block moves. Contiguous runs are
        merged into one copy per run. ProtocolError for a layer index either side lacks, layers
        placed differently (region, block or head size), or a block id outside 0..num_blocks-1 on
        its side (a negative id would reach into the layer before)."""
        if len(pairs) != self.num_groups:
            raise ProtocolError(f"{len(pairs)} groups of block pairs for {self.num_groups} KV cache groups")
        for pair in (pair for group in pairs for pair in group):
            if any(isinstance(b, bool) or not isinstance(b, int) or b < 0 for b in pair):
                raise ProtocolError(f"block pair {pair!r:.60} holds a negative or non-integer block id")
        batch = []
        for index in sorted(layers):
            if isinstance(index, bool) or not 0 <= index < min(len(self.layers), len(peer.layers)):
                raise ProtocolError(f"layer {index!r:.40} out of range ({len(self.layers)} local, {len(peer.layers)} remote layers)")
            mine, theirs = self.layers[index], peer.layers[index]
            if mine.region_id != theirs.region_id:
                raise ProtocolError(f"layer {index} lives in region {mine.region_id} here, {theirs.region_id} on the peer")
            group = pairs[self.group_of(index)]
            if isinstance(mine, BlockRuns) or isinstance(theirs, BlockRuns):
                batch.append(_runs_ops(index, mine, theirs, group, slicing))
                continue
            span = _head_span(index, mine, theirs, slicing)
            for block, other in group:
                if block >= mine.num_blocks or other >= theirs.num_blocks:
                    raise ProtocolError(
                        f"block pair ({block}, {other}) out of range "
                        f"({mine.num_blocks} local, {theirs.num_blocks} remote blocks)"
                    )
            ops = merge_contiguous(
                CopyOp(mine.offset + a * mine.block_bytes + span.local, theirs.offset + b * theirs.block_bytes + span.peer,
                       span.length)
                for a, b in group
            )
            batch.append(RegionOps(mine.region_id, tuple(ops)))
        return batch

    def local_ops(self, block_ids: Sequence[int]) -> list[RegionOps]:
        """Every layer's `block_ids` (one run of equal length per KV cache group, in group order)
        copied onto themselves: the ranges host staging moves between the device and its mirror."""
        n = len(block_ids) // self.num_groups
        pairs = [[(b, b) for b in block_ids[g * n:(g + 1) * n]] for g in range(self.num_groups)]
        return self.layer_ops(self, range(len(self.layers)), pairs)

    def to_wire(self) -> list[list[int]]:
        return [runs_to_wire(layer) if isinstance(layer, BlockRuns) else layer.to_wire() for layer in self.layers]

    @classmethod
    def from_wire(cls, data, region_sizes: Mapping[int, int] | None = None) -> KvLayout:
        """Parse a peer's layer table. With `region_sizes` (region id -> bytes, from the peer's
        region descriptors) also check that every layer lies inside an existing region and that
        layers sharing a region do not partly overlap (identical placements are allowed: layers
        that share one KV tensor alias it)."""
        if not isinstance(data, list):
            raise ProtocolError(f"layer table must be a list, got {type(data).__name__}")
        if not 0 < len(data) <= MAX_LAYERS:
            raise ProtocolError(f"layer table must have 1..{MAX_LAYERS} layers, got {len(data)}")
        layers = []
        for index, item in enumerate(data):
            try:
                is_runs = isinstance(item, list) and len(item) > RUNS_HEADER
                layers.append(runs_from_wire(item) if is_runs else LayerPlacement.from_wire(item))
            except ProtocolError as e:
                raise ProtocolError(f"layer {index}: {e}") from None
        layout = cls(tuple(layers))
        if region_sizes is not None:
            layout.check_fits(region_sizes)
        return layout

    def check_fits(self, region_sizes: Mapping[int, int]) -> None:
        """ProtocolError naming the layer that lies outside its region, or partly over another.
        Layers of block runs may interleave (a GPU layout whose layer axis is not outermost):
        only their bounds are checked."""
        by_region: dict[int, list[tuple[int, int, int]]] = {}
        for index, layer in enumerate(self.layers):
            size = region_sizes.get(layer.region_id)
            if size is None:
                raise ProtocolError(f"layer {index} is in region {layer.region_id}, which the peer does not have")
            end = runs_end(layer) if isinstance(layer, BlockRuns) else layer.end
            if end > size:
                raise ProtocolError(
                    f"layer {index} ends at byte {end}, beyond its region {layer.region_id} ({size} bytes)"
                )
            if isinstance(layer, LayerPlacement):
                by_region.setdefault(layer.region_id, []).append((layer.offset, layer.end, index))
        for region_id, spans in by_region.items():
            spans.sort()
            for (start, end, index), (next_start, next_end, next_index) in zip(spans, spans[1:]):
                if next_start < end and (start, end) != (next_start, next_end):
                    raise ProtocolError(
                        f"layers {index} and {next_index} overlap in region {region_id} "
                        f"(bytes {start}..{end} and {next_start}..{next_end})"
                    )


class _Span(NamedTuple):
    local: int  # bytes into the local block
    peer: int  # bytes into the peer's block
    length: int


def _head_span(index: int, mine: LayerPlacement, theirs: LayerPlacement, slicing: Slicing | None) -> _Span:
    """The byte range of each block that moves: the whole block, or the shared heads' range."""
    if slicing is None:
        if mine.block_bytes != theirs.block_bytes:
            raise ProtocolError(f"layer {index} has {mine.block_bytes}-byte blocks here, {theirs.block_bytes} on the peer")
        return _Span(0, 0, mine.block_bytes)
    heads, local_heads, peer_heads = slicing.heads, slicing.local_heads, slicing.peer_heads
    head_bytes = mine.block_bytes // local_heads
    if head_bytes * local_heads != mine.block_bytes or theirs.block_bytes != head_bytes * peer_heads:
        raise ProtocolError(f"layer {index}: {mine.block_bytes}-byte blocks of {local_heads} heads here, "
                            f"{theirs.block_bytes}-byte blocks of {peer_heads} heads on the peer")
    if heads.first_local + heads.count > local_heads or heads.first_peer + heads.count > peer_heads:
        raise ProtocolError(f"layer {index}: heads {heads} lie outside the blocks")
    return _Span(heads.first_local * head_bytes, heads.first_peer * head_bytes, heads.count * head_bytes)


def _as_runs(layer: Placement) -> BlockRuns:
    if isinstance(layer, BlockRuns):
        return layer
    return BlockRuns(layer.region_id, layer.offset, layer.block_bytes, layer.block_bytes, (0,), layer.num_blocks)


def _runs_ops(index: int, mine: Placement, theirs: Placement, group: Sequence[tuple[int, int]],
              slicing: Slicing | None) -> RegionOps:
    """A layer's copies when either side's blocks are runs: run k to run k; with `slicing`, the
    shared heads' range of each run (the runs are head-major: the handshake checks it)."""
    mine, theirs = _as_runs(mine), _as_runs(theirs)
    if slicing is None:
        try:
            return mine.copy_ops(theirs, group)
        except ProtocolError as e:
            raise ProtocolError(f"layer {index}: {e}") from None
    if len(mine.run_offsets) != len(theirs.run_offsets):
        raise ProtocolError(f"layer {index}: {len(mine.run_offsets)} runs per block here, "
                            f"{len(theirs.run_offsets)} on the peer")
    span = _head_span(index, LayerPlacement(mine.region_id, 0, mine.run_bytes, 1),
                      LayerPlacement(theirs.region_id, 0, theirs.run_bytes, 1), slicing)
    sliced_mine = BlockRuns(mine.region_id, mine.offset + span.local, mine.block_stride, span.length,
                            mine.run_offsets, mine.num_blocks)
    sliced_theirs = BlockRuns(theirs.region_id, theirs.offset + span.peer, theirs.block_stride, span.length,
                              theirs.run_offsets, theirs.num_blocks)
    try:
        return sliced_mine.copy_ops(sliced_theirs, group)
    except ProtocolError as e:
        raise ProtocolError(f"layer {index}: {e}") from None
