"""`KvMemory`: the worker's KV cache, moved into shared memory and registered with the transport.

It knows the layout peers copy into (`layout`), the fingerprint a peer must match to copy at all
(`fingerprint`), and which vLLM layer name is which layer index (`layer_index`). The segments
have no name once registered: nothing of them outlives the process; `close` unmaps them.
"""

from __future__ import annotations

import hashlib

from pdserve.connector.kv_groups import ONE_GROUP, KvGroups
from pdserve.connector.layout import KvLayout, LayerPlacement, cpu_isa
from pdserve.errors import PDServeError
from pdserve.transport.base import Transport
from pdserve.transport.shm_tensor import move_tensors_to_shared_memory


class KvMemory:
    def __init__(self, model_fingerprint: dict, token: str, groups: KvGroups = ONE_GROUP):
        self._model_fingerprint = model_fingerprint
        self._groups = groups
        self._token = token  # names this process's segments
        self.fingerprint: dict = {}
        self.layout: KvLayout | None = None
        self.layer_index: dict[str, int] = {}
        self._segments: list = []

    def register(self, kv_caches: dict, transport: Transport, local_heads: int | None) -> None:
        """Called once, from vLLM's `register_kv_caches`, with every layer's KV tensor (each block
        holding `local_heads` heads, outermost: ranks of other TP sizes copy them in slices;
        None: not checked)."""
        placements = move_tensors_to_shared_memory(kv_caches, self._token)
        region_ids: dict[int, int] = {}
        layers = []
        for index, (name, tensor) in enumerate(kv_caches.items()):
            if not tensor.is_contiguous():
                raise PDServeError(f"KV cache of {name} is not contiguous; PDConnector needs block-contiguous KV")
            if local_heads is not None and (tensor.dim() != 4 or tensor.shape[1] != local_heads):
                raise PDServeError(f"KV cache of {name} has shape {list(tensor.shape)}; PDConnector needs "
                                   f"[blocks, {local_heads} heads, block size, head bytes]")
            placement = placements[name]
            segment = placement.segment
            if id(segment) not in region_ids:
                region_ids[id(segment)] = len(region_ids)
                # From here on the segment has no name: nothing can outlive this process.
                transport.register_region(region_ids[id(segment)], segment.address, segment.size,
                                          segment.unlink_name())
                self._segments.append(segment)
            block_bytes = tensor.stride(0) * tensor.element_size()
            layers.append(LayerPlacement(region_ids[id(segment)], placement.byte_offset, block_bytes, tensor.shape[0]))
            self.layer_index[name] = index
        first = next(iter(kv_caches.values()))
        # per head: what must match between ranks of any tensor-parallel sizes (heads per rank may differ)
        shapes = "|".join(f"{name}:{t.dtype}:{list(t.shape[2:])}:{t.stride(1)}" for name, t in kv_caches.items())
        self.fingerprint = {
            **self._model_fingerprint,
            "kv_dtype": str(first.dtype),
            "kv_head_shape": list(first.shape[2:]),
            "kv_layers": hashlib.sha256("|".join(kv_caches).encode()).hexdigest()[:16],
            "kv_layer_shapes": hashlib.sha256(shapes.encode()).hexdigest()[:16],
            "kv_regions": [layer.region_id for layer in layers],
            "kv_groups": list(self._groups.described),
            "cpu_isa": cpu_isa(),
        }
        groups = tuple(self._groups.group_of(name) for name in kv_caches) if self._groups.num_groups > 1 else ()
        self.layout = KvLayout(tuple(layers), groups, self._groups.windowed)

    def close(self) -> None:
        for segment in self._segments:
            segment.close()
        self._segments = []
