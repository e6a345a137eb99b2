"""`KvMemory`: the worker's KV cache, registered with the transport.

It knows the layout peers copy into (`layout`), the fingerprint a peer must match to copy at all
(`fingerprint`), and which vLLM layer name is which layer index (`layer_index`).

KV in host memory (`register`) is moved into shared memory; the segments have no name once
registered: nothing of them outlives the process; `close` unmaps them. KV on a GPU
(`register_device`) stays where vLLM put it: each storage is registered with the device transport
(device_transport.py), each layer placed from its tensor's strides (device_layout.py), and the
fingerprint names the device and every layer's block format instead of the CPU's ISA.
"""

from __future__ import annotations

import hashlib
import re

from pdserve.connector.kv_groups import ONE_GROUP, KvGroups
from pdserve.errors import PDServeError
from pdserve.transfer.device_layout import HEAD, VLLM_VIEW_ROLES, BlockRuns, KvTensorLayout
from pdserve.transfer.layout import KvLayout, LayerPlacement, Placement
from pdserve.transport.base import Transport
from pdserve.transport.device_transport import register_device_tensors
from pdserve.transport.shm_tensor import move_tensors_to_shared_memory

# ranks of other tensor-parallel sizes hold other numbers of heads; a format with one head per
# rank has no head dim at all, so such peers are refused (docs/gpu.md)
_HEAD_COUNT = re.compile(rf"(?<![a-z]){HEAD}\d+")


class KvMemory:
    def __init__(self, model_fingerprint: dict, token: str, groups: KvGroups = ONE_GROUP):
        self._model_fingerprint = model_fingerprint
        self._groups = groups
        self._token = token  # names this process's segments
        self.fingerprint: dict = {}
        self.layout: KvLayout | None = None
        self.layer_index: dict[str, int] = {}
        self.head_major = True  # a block's heads are its outermost dim: ranks of other TP sizes copy head ranges
        self._segments: list = []

    def register(self, kv_caches: dict, transport: Transport, local_heads: int | None) -> None:
        """Called once, from vLLM's `register_kv_caches`, with every layer's KV tensor (each block
        holding `local_heads` heads, outermost: ranks of other TP sizes copy them in slices;
        None: not checked). A state layer's blocks are padded pages (`_state_runs`)."""
        for name, tensor in kv_caches.items():  # before any shared memory exists: a refusal leaves nothing
            if not self._is_state(name):
                self._check_shape(name, tensor, local_heads)
        placements = move_tensors_to_shared_memory(kv_caches, self._token)
        region_ids: dict[int, int] = {}
        layers: list[Placement] = []
        for index, (name, tensor) in enumerate(kv_caches.items()):
            state = self._is_state(name)
            placement = placements[name]
            segment = placement.segment
            if id(segment) not in region_ids:
                region_ids[id(segment)] = len(region_ids)
                # the name goes with the registration: peers on this host map the segment by it
                transport.register_region(region_ids[id(segment)], segment.address, segment.size,
                                          segment.unlink_name())
                self._segments.append(segment)
            region = region_ids[id(segment)]
            if state:
                layers.append(_state_runs(name, tensor, region, placement.byte_offset))
            else:
                layers.append(LayerPlacement(region, placement.byte_offset, tensor.stride(0) * tensor.element_size(),
                                             tensor.shape[0]))
            self.layer_index[name] = index
        self._describe(kv_caches, layers, {"cpu_isa": cpu_isa()})

    def _is_state(self, name: str) -> bool:
        return self._groups.state_mode(self._groups.group_of(name)) is not None

    def _check_shape(self, name: str, tensor, local_heads: int | None) -> None:
        if not tensor.is_contiguous():
            raise PDServeError(f"KV cache of {name} is not contiguous; PDConnector needs block-contiguous KV")
        if local_heads is not None and (tensor.dim() != 4 or tensor.shape[1] != local_heads):
            raise PDServeError(f"KV cache of {name} has shape {list(tensor.shape)}; PDConnector needs "
                               f"[blocks, {local_heads} heads, block size, head bytes]")

    def register_device(self, kv_caches: dict, transport, local_heads: int | None) -> None:
        """`register` for KV on a GPU: vLLM's per-layer views `[blocks, heads, tokens, content]`
        in any stride order; `transport` has `register_tensor` (device_transport.py)."""
        for name, tensor in kv_caches.items():
            if self._is_state(name):
                raise PDServeError(f"layer {name} keeps mamba or linear-attention state on a GPU, which PDConnector "
                                   "moves from host memory only")
            if local_heads is not None and (tensor.dim() != 4 or tensor.shape[1] != local_heads):
                raise PDServeError(f"KV cache of {name} has shape {list(tensor.shape)}; PDConnector needs "
                                   f"[blocks, {local_heads} heads, block size, head bytes]")
        placements = register_device_tensors(kv_caches, transport)
        layers, formats = [], []
        for index, (name, tensor) in enumerate(kv_caches.items()):
            tensor_layout = KvTensorLayout.from_tensor(tensor, VLLM_VIEW_ROLES, placements[name].region_id)
            layers.append(_placement(tensor_layout))
            formats.append(_HEAD_COUNT.sub(HEAD, tensor_layout.block_format()))
            self.head_major = self.head_major and formats[-1].startswith(f"block:{HEAD}:")
            self.layer_index[name] = index
        first = next(iter(kv_caches.values()))
        self._describe(kv_caches, layers, {"kv_device": device_name(first),
                                           "kv_block_format": "|".join(sorted(set(formats)))})

    def _describe(self, kv_caches: dict, layers: list[Placement], memory: dict) -> None:
        """Set the fingerprint (the model's, the KV's, and `memory`: what decides how a block's
        bytes are packed) and the layout."""
        attention = [t for name, t in kv_caches.items() if not self._is_state(name)]
        first = attention[0] if attention else next(iter(kv_caches.values()))
        # per head: what must match between ranks of any tensor-parallel sizes (heads per rank may differ)
        shapes = "|".join(f"{name}:state:{t.dtype}:{list(t.shape[1:])}" if self._is_state(name)
                          else f"{name}:{t.dtype}:{list(t.shape[2:])}:{t.stride(1)}" for name, t in kv_caches.items())
        self.fingerprint = {
            **self._model_fingerprint,
            "kv_dtype": str(first.dtype),
            "kv_head_shape": list(first.shape[2:]),
            "kv_layers": hashlib.sha256("|".join(kv_caches).encode()).hexdigest()[:16],
            "kv_layer_shapes": hashlib.sha256(shapes.encode()).hexdigest()[:16],
            "kv_regions": [layer.region_id for layer in layers],
            "kv_groups": list(self._groups.described),
            **memory,
        }
        groups = tuple(self._groups.group_of(name) for name in kv_caches) if self._groups.num_groups > 1 else ()
        self.layout = KvLayout(tuple(layers), groups, self._groups.sparse)

    def close(self) -> None:
        for segment in self._segments:
            segment.close()
        self._segments = []


def _state_runs(name: str, tensor, region_id: int, offset: int) -> BlockRuns:
    """Where a mamba/linear-attention layer's blocks live: vLLM views its state as `[blocks, ...]`
    bytes, each block's state packed at the start of a page padded to the attention page size
    (vLLM's `page_size_padded`); only the state moves, not the padding. PDServeError for a state
    laid out otherwise."""
    content = tensor[0].numel() * tensor.element_size()
    stride = tensor.stride(0) * tensor.element_size()
    if tensor.dim() < 2 or not tensor[0].is_contiguous() or stride < content:
        raise PDServeError(f"state of {name} has shape {list(tensor.shape)} and strides {tensor.stride()}; "
                           "PDConnector needs each block's state as one range inside its block stride")
    return BlockRuns(region_id, offset, stride, content, (0,), tensor.shape[0])


def _placement(tensor_layout: KvTensorLayout) -> Placement:
    """A layer whose blocks are one range each, back to back, as the host KV's `LayerPlacement`
    (the same wire form); block runs otherwise."""
    runs = tensor_layout.blocks()
    if runs.contiguous and runs.block_stride == runs.run_bytes:
        return LayerPlacement(runs.region_id, runs.offset + runs.run_offsets[0], runs.run_bytes, runs.num_blocks)
    return runs


def device_name(tensor) -> str:
    """What decides how the device packs a KV block: the GPU's name; for CPU tensors standing in
    for a device (tests, gpu_check --device cpu) the CPU's ISA."""
    import torch  # lazy: heavy, and only a registering worker needs it

    return torch.cuda.get_device_name(tensor.device) if tensor.is_cuda else cpu_isa()


def cpu_isa() -> str:
    """The CPU ISA that decides how vLLM's CPU attention packs KV blocks."""
    import torch  # lazy: heavy, and only a registering worker needs it

    isa = torch.backends.cpu.get_cpu_capability()
    try:
        if torch._C._cpu._is_amx_tile_supported():
            isa += "+AMX"
    except AttributeError:
        pass
    return isa
