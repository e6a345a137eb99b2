"""KV cache groups from vLLM's own KVCacheConfig (its spec classes, as vLLM hands them to the
connector): which groups PDConnector moves, how the fingerprint names them, and the flat block
list every message carries, group after group (a state group's: its state block last)."""

from __future__ import annotations

import pytest
import torch
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
from vllm.v1.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)

from pdserve.connector.kv_groups import ONE_GROUP, KvGroups
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


def test_an_mla_group_moves_whole_like_full_attention_and_is_named_mla():
    mla = MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=576, dtype=torch.bfloat16)
    groups = KvGroups.from_kv_cache_config(config((["l0", "l1"], mla)), 16)
    assert groups.described == ("mla",)
    assert groups.windowed == (False,)
    assert groups.state == ()


def test_a_group_of_a_kind_it_cannot_move_is_refused_naming_its_kind():
    spec = ChunkedLocalAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=64, dtype=torch.bfloat16,
                                     attention_chunk_size=64)
    with pytest.raises(ConfigError, match=r"cannot move KV cache group 0 \(ChunkedLocalAttentionSpec\)"):
        KvGroups.from_kv_cache_config(config((["l0", "l1"], spec)), BLOCK)


def mamba(mode="align", block=BLOCK, speculative=0, kind=MambaAttentionBackendEnum.GDN_ATTN):
    return MambaSpec(block_size=block, shapes=((3, 512), (4, 64, 64)), dtypes=(torch.bfloat16, torch.float32),
                     mamba_cache_mode=mode, num_speculative_blocks=speculative, mamba_type=kind)


def test_a_mamba_group_is_a_state_group_named_by_its_shapes():
    groups = KvGroups.from_kv_cache_config(config((["m0"], mamba()), (["l1"], full())), BLOCK)
    assert groups.state == ("align", None) and groups.has_state
    assert groups.sparse == (True, False)
    assert groups.described == ("state:[3, 512]:bfloat16,[4, 64, 64]:float32", "full")


def test_state_groups_without_prefix_caching_keep_one_block_of_any_size():
    groups = KvGroups.from_kv_cache_config(config((["m0"], mamba("none", block=4096)), (["l1"], full())), BLOCK)
    assert groups.state == ("none", None)


@pytest.mark.parametrize(("spec", "rule"), [(mamba("all"), "mamba_cache_mode 'all'"),
                                            (mamba(speculative=1), "speculative decoding"),
                                            (mamba(kind=MambaAttentionBackendEnum.MAMBA1), "MAMBA1 layers")])
def test_state_kept_in_ways_pdconnector_does_not_move_is_refused_naming_why(spec, rule):
    with pytest.raises(ConfigError, match=f"group 0 .*{rule}"):
        KvGroups.from_kv_cache_config(config((["m0"], spec), (["l1"], full())), BLOCK)


def test_a_state_group_moves_whole_kernel_chunks_leaving_d_two_tokens_or_more():
    gdn = KvGroups.from_kv_cache_config(config((["m0"], mamba()), (["l1"], full())), BLOCK)
    assert gdn.state_chunk == 64
    assert [gdn.moved_tokens(n) for n in (1, 2, 65, 66, 129, 130, 300)] == [0, 0, 0, 64, 64, 128, 256]
    ssd = KvGroups.from_kv_cache_config(config((["m0"], mamba(kind=MambaAttentionBackendEnum.MAMBA2)),
                                               (["l1"], full())), BLOCK, mamba_chunk=256)
    assert ssd.moved_tokens(300) == 256 and ssd.moved_tokens(258) == 256 and ssd.moved_tokens(257) == 0
    assert ONE_GROUP.moved_tokens(300) == 300


def test_a_state_groups_run_names_only_the_block_holding_the_state_last():
    align = KvGroups.from_kv_cache_config(config((["m0"], mamba()), (["l1"], full())), BLOCK)
    assert align.prompt_blocks(([0, 7, 8], [4, 5, 6]), 2) == (0, 7, 4, 5)  # column 1: the last computed token's
    one = KvGroups.from_kv_cache_config(config((["m0"], mamba("none", 4096)), (["l1"], full())), BLOCK)
    assert one.prompt_blocks(([9], [4, 5, 6]), 3) == (0, 0, 9, 4, 5, 6)
    with pytest.raises(ProtocolError, match="group 0 holds 1 blocks; the prompt needs 2"):
        align.prompt_blocks(([9], [4, 5]), 2)


def test_groups_of_another_block_size_are_refused():
    with pytest.raises(ConfigError, match="group 1 has 64-token blocks, the cache 128"):
        KvGroups.from_kv_cache_config(config((["l0"], full()), (["l1"], full(64))), BLOCK)


def test_a_prompts_blocks_travel_group_after_group_and_a_short_group_is_a_protocol_error():
    two = KvGroups({}, (False, False), ("full", "full"))
    assert two.prompt_blocks(([5, 6, 7], [0, 9, 8]), 2) == (5, 6, 0, 9)
    assert ONE_GROUP.prompt_blocks(([5, 6, 7],), 3) == (5, 6, 7)
    with pytest.raises(ProtocolError, match="group 1 holds 1 blocks; the prompt needs 2"):
        two.prompt_blocks(([5, 6], [9]), 2)
