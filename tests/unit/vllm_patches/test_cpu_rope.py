"""pdserve's patch of vLLM's CPU rotary kernel for 3-D query and key (pdserve.vllm_patches.cpu_rope).

vLLM's own RotaryEmbedding, with the tensors vLLM's MLA layer hands it: the rotary slice of each
query head inside `[tokens, heads, 128]` and the rotary key inside each token's 576-wide latent row.
The kernel's answer is held against vLLM's own pure-PyTorch `forward_native`.
"""

from __future__ import annotations

import logging

import pytest
import torch
from vllm.config import VllmConfig, set_current_vllm_config
from vllm.model_executor.layers.rotary_embedding import get_rope
from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

from pdserve.connector.plugin import register
from pdserve.vllm_patches import cpu_rope

TOKENS, HEADS, NOPE, ROPE, LATENT = 7, 4, 64, 64, 512


@pytest.fixture(scope="module")
def rope():
    with set_current_vllm_config(VllmConfig()):
        return get_rope(ROPE, max_position=4096, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                        is_neox_style=False)


def mla_inputs(seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    positions = torch.arange(TOKENS) + 5
    query = torch.randn(TOKENS, HEADS, NOPE + ROPE, generator=generator)
    latent = torch.randn(TOKENS, LATENT + ROPE, generator=generator)
    return positions, query, latent


def native(rope, positions, query, latent):
    return rope.forward_native(positions, query[..., NOPE:].clone(), latent[:, LATENT:].unsqueeze(1).clone())


def test_unpatched_kernel_rotates_mla_slices_at_the_wrong_places(rope):
    """The defect the patch exists for, on the kernel as vLLM ships it (fails once vLLM fixes it)."""
    positions, query, latent = mla_inputs()
    want_q, want_k = native(rope, positions, query, latent)
    unpatched = getattr(RotaryEmbedding.forward_cpu, "__wrapped__", RotaryEmbedding.forward_cpu)
    got_q, got_k = unpatched(rope, positions, query[..., NOPE:], latent[:, LATENT:].unsqueeze(1))
    assert (got_q - want_q).abs().max() > 0.1
    assert (got_k - want_k).abs().max() > 0.1


def test_patched_kernel_rotates_mla_slices_as_native_does_and_leaves_the_rest(rope):
    register()  # the plugin entry point, as in every vLLM process
    assert cpu_rope.applied()
    positions, query, latent = mla_inputs()
    before_q, before_latent = query.clone(), latent.clone()
    want_q, want_k = native(rope, positions, query, latent)

    got_q, got_k = rope.forward_cpu(positions, query[..., NOPE:], latent[:, LATENT:].unsqueeze(1))

    torch.testing.assert_close(got_q, want_q, rtol=0, atol=1e-5)
    torch.testing.assert_close(got_k, want_k, rtol=0, atol=1e-5)
    torch.testing.assert_close(query[..., NOPE:], want_q, rtol=0, atol=1e-5)  # in place, as vLLM expects
    torch.testing.assert_close(latent[:, LATENT:], want_k.squeeze(1), rtol=0, atol=1e-5)
    assert torch.equal(query[..., :NOPE], before_q[..., :NOPE])
    assert torch.equal(latent[:, :LATENT], before_latent[:, :LATENT])


def test_patched_kernel_keeps_two_dimensional_inputs_on_the_kernel_path(rope):
    register()
    positions, query, latent = mla_inputs(seed=1)
    flat = query[..., NOPE:].reshape(TOKENS, HEADS * ROPE).clone()
    want, _ = rope.forward_native(positions, flat.clone().view(TOKENS, HEADS, ROPE), None)
    got, _ = rope.forward_cpu(positions, flat, None)
    torch.testing.assert_close(got.view(TOKENS, HEADS, ROPE), want, rtol=0, atol=1e-5)


def test_code_that_does_not_match_is_left_alone_with_a_warning(caplog):
    class OtherRope:
        def forward_cpu(self, positions, query, key=None):
            return query, key

    with caplog.at_level(logging.WARNING, logger="pdserve"):
        assert cpu_rope.patch_rotary_embedding(OtherRope) is False
    assert "left out" in caplog.text and "no longer calls" in caplog.text
    assert not hasattr(OtherRope, cpu_rope.PATCHED_MARK)
