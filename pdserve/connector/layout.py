"""Where each attention layer's KV blocks live, and the fingerprint two peers must share.

vLLM's CPU backend keeps one tensor per attention layer, `[num_blocks, num_kv_heads,
block_size, 2*head_size]`, block-contiguous, and packs the bytes inside a block ISA-specifically
(AMX tiles), so blocks move as opaque bytes and both sides must agree on dtype, block size,
layout and ISA. That agreement is the fingerprint, checked in the handshake.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.errors import IncompatiblePeerError, ProtocolError
from pdserve.transport.base import CopyOp, RegionOps


@dataclass(frozen=True)
class LayerPlacement:
    region_id: int  # the shared-memory region holding this layer
    offset: int  # byte offset of block 0 inside the region
    block_bytes: int
    num_blocks: int

    def to_wire(self) -> list[int]:
        return [self.region_id, self.offset, self.block_bytes, self.num_blocks]

    @classmethod
    def from_wire(cls, data) -> LayerPlacement:
        if not (isinstance(data, list) and len(data) == 4 and all(isinstance(x, int) and x >= 0 for x in data)):
            raise ProtocolError(f"layer placement must be 4 non-negative integers, got {data!r}")
        return cls(*data)


@dataclass(frozen=True)
class KvLayout:
    layers: tuple[LayerPlacement, ...]  # in model order; index = layer index

    def layer_ops(self, peer: KvLayout, layers, pairs: list[tuple[int, int]]) -> list[RegionOps]:
        """Copy lists for `layers`, moving local block a to peer block b for each (a, b) pair.

        Contiguous runs are merged into one copy per run."""
        from pdserve.transport.base import merge_contiguous

        batch = []
        for index in sorted(layers):
            mine, theirs = self.layers[index], peer.layers[index]
            if mine.region_id != theirs.region_id:
                raise ProtocolError(f"layer {index} lives in region {mine.region_id} here, {theirs.region_id} on the peer")
            for block, other in pairs:
                if block >= mine.num_blocks or other >= theirs.num_blocks:
                    raise ProtocolError(
                        f"block pair ({block}, {other}) out of range "
                        f"({mine.num_blocks} local, {theirs.num_blocks} remote blocks)"
                    )
            ops = merge_contiguous(
                CopyOp(mine.offset + a * mine.block_bytes, theirs.offset + b * theirs.block_bytes, mine.block_bytes)
                for a, b in pairs
            )
            batch.append(RegionOps(mine.region_id, tuple(ops)))
        return batch

    def to_wire(self) -> list[list[int]]:
        return [layer.to_wire() for layer in self.layers]

    @classmethod
    def from_wire(cls, data) -> KvLayout:
        if not isinstance(data, list):
            raise ProtocolError("layer table must be a list")
        return cls(tuple(LayerPlacement.from_wire(item) for item in data))


def check_compatible(local: dict, remote: dict, peer: str) -> None:
    """Raise IncompatiblePeerError naming every differing fingerprint field."""
    keys = sorted(set(local) | set(remote))
    diffs = [f"{k}: ours {local.get(k)!r}, theirs {remote.get(k)!r}" for k in keys if local.get(k) != remote.get(k)]
    if diffs:
        raise IncompatiblePeerError(f"peer {peer} has an incompatible KV cache ({'; '.join(diffs)})")


def cpu_isa() -> str:
    """The CPU ISA that decides how vLLM's CPU attention packs KV blocks."""
    import torch

    isa = torch.backends.cpu.get_cpu_capability()
    try:
        if torch._C._cpu._is_amx_tile_supported():
            isa += "+AMX"
    except AttributeError:
        pass
    return isa
