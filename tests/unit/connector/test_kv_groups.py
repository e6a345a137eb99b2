"""KV cache groups from vLLM's own KVCacheConfig (its spec classes, as vLLM hands them to the
connector): which groups PDConnector moves, how the fingerprint names them, and the flat block
list every message carries, group after group."""

from __future__ import annotations

import pytest
import torch
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)

from pdserve.connector.kv_groups import ONE_GROUP, KvGroups, flat_prompt_blocks
from pdserve.errors import ConfigError, ProtocolError

BLOCK = 128


def config(*groups: tuple[list[str], object]) -> KVCacheConfig:
    return KVCacheConfig(num_blocks=64, kv_cache_tensors=[],
                         kv_cache_groups=[KVCacheGroupSpec(names, spec) for names, spec in groups])


def full(block=BLOCK):
    return FullAttentionSpec(block_size=block, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)


def test_no_groups_is_one_full_attention_group():
    assert KvGroups.from_kv_cache_config(None, BLOCK) is ONE_GROUP
    assert KvGroups.from_kv_cache_config(config(), BLOCK) is ONE_GROUP


def test_sliding_window_and_full_groups_are_moved_and_named_with_their_window():
    window = SlidingWindowSpec(block_size=BLOCK, num_kv_heads=2, head_size=64, dtype=torch.bfloat16,
                               sliding_window=160)
    groups = KvGroups.from_kv_cache_config(config((["l0", "l2"], window), (["l1", "l3"], full())), BLOCK)
    assert groups.num_groups == 2
    assert groups.windowed == (True, False)
    assert groups.described == ("sliding_window:160", "full")
    assert [groups.group_of(n) for n in ("l0", "l1", "l2", "l3")] == [0, 1, 0, 1]


def test_an_mla_group_is_refused_naming_its_kind():
    mla = MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=576, dtype=torch.bfloat16)
    with pytest.raises(ConfigError, match=r"cannot move KV cache group 0 \(MLAAttentionSpec\)"):
        KvGroups.from_kv_cache_config(config((["l0", "l1"], mla)), 16)


def test_a_mamba_group_is_refused_naming_its_kind():
    mamba = MambaSpec(block_size=BLOCK, shapes=((4, 64), (2, 16, 16)), dtypes=(torch.bfloat16, torch.bfloat16))
    with pytest.raises(ConfigError, match=r"cannot move KV cache group 1 \(MambaSpec\)"):
        KvGroups.from_kv_cache_config(config((["l0"], full()), (["m1"], mamba)), BLOCK)


def test_groups_of_another_block_size_are_refused():
    with pytest.raises(ConfigError, match="group 1 has 64-token blocks, the cache 128"):
        KvGroups.from_kv_cache_config(config((["l0"], full()), (["l1"], full(64))), BLOCK)


def test_a_prompts_blocks_travel_group_after_group_and_a_short_group_is_a_protocol_error():
    assert flat_prompt_blocks(([5, 6, 7], [0, 9, 8]), 2) == (5, 6, 0, 9)
    assert flat_prompt_blocks(([5, 6, 7],), 3) == (5, 6, 7)
    with pytest.raises(ProtocolError, match="group 1 holds 1 blocks; the prompt needs 2"):
        flat_prompt_blocks(([5, 6], [9]), 2)
