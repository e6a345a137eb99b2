"""Llama (`LlamaForCausalLM`): full attention in every layer, untied lm_head."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pdserve.model.archs import blocks
from pdserve.model.archs.base import Architecture, SpecialTokens, Tensors, base_config
from pdserve.model.spec import SIZES, ModelSpec

if TYPE_CHECKING:
    from pdserve.model.weights import WeightDraw


def hf_config(spec: ModelSpec, tokens: SpecialTokens) -> dict:
    return base_config(spec, tokens) | {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "intermediate_size": spec.intermediate_size, "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads, "head_dim": spec.head_dim,
        "hidden_act": "silu", "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "rope_scaling": None,
        "attention_bias": False, "mlp_bias": False, "attention_dropout": 0.0, "tie_word_embeddings": False,
    }


def init_weights(spec: ModelSpec, draw: WeightDraw) -> Tensors:
    return blocks.pre_norm_decoder(draw, spec, blocks.attention)


ARCH = Architecture("llama", SIZES, hf_config, init_weights)
