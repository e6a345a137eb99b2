"""KvMemory.register for a hybrid model's KV cache as vLLM allocates it: one int8 buffer, every
layer a view of it with one page per block; an attention layer's page is its KV, a state
layer's page holds the request's state at its start and padding after (vLLM's `page_size_padded`).
The state layer is placed as one run per page (only the state moves); a state laid out otherwise
is refused naming the layer."""

from __future__ import annotations

import os

import pytest
import torch

from pdserve.connector.kv_groups import KvGroups
from pdserve.connector.worker.kv_memory import KvMemory
from pdserve.errors import PDServeError
from pdserve.transfer.device_layout import BlockRuns
from pdserve.transfer.layout import LayerPlacement

BLOCKS, HEADS, TOKENS, HEAD_BYTES = 8, 2, 16, 64
PAGE = HEADS * TOKENS * HEAD_BYTES  # bytes of one attention block
STATE = 1536  # bytes of one request's state, padded to PAGE
GROUPS = KvGroups({"attn": 0, "gdn": 1}, (False, False), ("full", "state:x"), (None, "align"), 64)


class Regions:
    def __init__(self):
        self.regions: list[tuple[int, int]] = []

    def register_region(self, region_id, address, size, name=None) -> None:
        self.regions.append((region_id, size))


def vllm_like_caches(state_stride: int = PAGE, state_bytes: int = STATE) -> dict:
    raw = torch.zeros(BLOCKS * PAGE, dtype=torch.int8)
    attention = raw.view(BLOCKS, HEADS, TOKENS, HEAD_BYTES).view(torch.bfloat16)
    state = torch.as_strided(raw, (BLOCKS, 1, 1, state_bytes), (state_stride, state_bytes, state_bytes, 1))
    return {"attn": attention, "gdn": state}


def test_a_state_layer_is_placed_as_its_state_at_the_start_of_each_page():
    memory = KvMemory({"model": "hybrid"}, "kvstatetest", GROUPS)
    try:
        regions = Regions()
        memory.register(vllm_like_caches(), regions, local_heads=HEADS)
        assert len(regions.regions) == 1, "the layers share vLLM's one buffer"
        attention, state = memory.layout.layers
        assert attention == LayerPlacement(0, 0, PAGE, BLOCKS)
        assert state == BlockRuns(0, 0, PAGE, STATE, (0,), BLOCKS)
        assert memory.layout.groups == (0, 1) and memory.layout.sparse == (False, True)
        assert memory.fingerprint["kv_groups"] == ["full", "state:x"]
        other = KvMemory({"model": "hybrid"}, "kvstatetest3", GROUPS)
        try:
            other.register(vllm_like_caches(state_bytes=STATE // 2), Regions(), local_heads=HEADS)
            assert other.fingerprint["kv_layer_shapes"] != memory.fingerprint["kv_layer_shapes"], \
                "a peer whose state differs in size is told apart at the handshake"
        finally:
            other.close()
    finally:
        memory.close()


def test_a_state_larger_than_its_block_stride_is_refused_naming_the_layer():
    memory = KvMemory({"model": "hybrid"}, "kvstatetest2", GROUPS)
    try:
        with pytest.raises(PDServeError, match="state of gdn has shape"):
            memory.register(vllm_like_caches(state_stride=STATE // 2, state_bytes=STATE // 2 * 2), Regions(),
                            local_heads=HEADS)
    finally:
        memory.close()


def test_a_kv_cache_of_the_wrong_shape_is_refused_before_any_shared_memory_exists():
    before = {n for n in os.listdir("/dev/shm") if "kvshapetest" in n}
    memory = KvMemory({"model": "m"}, "kvshapetest", KvGroups({}, (False,), ("full",), (), 1))
    with pytest.raises(PDServeError, match=r"KV cache of l0 has shape \[8, 16, 576\]"):
        memory.register({"l0": torch.zeros(BLOCKS, TOKENS, 576, dtype=torch.bfloat16)}, Regions(), local_heads=1)
    assert {n for n in os.listdir("/dev/shm") if "kvshapetest" in n} == before, "a refused cache leaves no segment"
