"""Gemma 2 (`Gemma2ForCausalLM`): sliding-window and global layers alternating, soft-capped logits.

Gemma's RMSNorm scales by (1 + weight). lm_head is the embedding (tied), so a hidden state that
still carries the input token's embedding predicts that token again: the norms after each
sublayer scale its output up until the token's own embedding is a small part of the residual,
and the final norm scales up so that the small tied embedding still spreads the logits by a few nats.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import TYPE_CHECKING

from pdserve.model.archs import blocks
from pdserve.model.archs.base import Architecture, SpecialTokens, Tensors, base_config
from pdserve.model.scales import EMBED_STD
from pdserve.model.spec import TINY, ModelSpec, SlidingWindowSpec

if TYPE_CHECKING:
    from pdserve.model.weights import WeightDraw

SIZES = {"tiny": SlidingWindowSpec(**asdict(TINY), sliding_window=128)}
NORM_SCALES = {"input_layernorm": 1.0, "post_attention_layernorm": 4.0, "pre_feedforward_layernorm": 1.0,
               "post_feedforward_layernorm": 4.0}
FINAL_NORM_SCALE = 8.0


def layer_types(num_layers: int) -> list[str]:
    """Even layers slide, odd layers see the whole sequence (Gemma 2's own order)."""
    return ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)]


def hf_config(spec: ModelSpec, tokens: SpecialTokens) -> dict:
    assert isinstance(spec, SlidingWindowSpec)
    return base_config(spec, tokens) | {
        "architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2",
        "intermediate_size": spec.intermediate_size, "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads, "head_dim": spec.head_dim,
        "hidden_activation": "gelu_pytorch_tanh", "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "query_pre_attn_scalar": spec.head_dim, "sliding_window": spec.sliding_window,
        "layer_types": layer_types(spec.num_layers),
        "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0,
        "attention_bias": False, "attention_dropout": 0.0, "tie_word_embeddings": True,
    }


def init_weights(spec: ModelSpec, draw: WeightDraw) -> Tensors:
    h = spec.hidden_size
    tensors = {"model.embed_tokens.weight": draw.normal(spec.vocab_size, h, std=EMBED_STD)}
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        tensors |= blocks.attention(draw, p + "self_attn.", spec)
        tensors |= blocks.gated_mlp(draw, p + "mlp.", h, spec.intermediate_size)
        tensors |= {f"{p}{norm}.weight": draw.full(h, value=scale - 1.0) for norm, scale in NORM_SCALES.items()}
    tensors["model.norm.weight"] = draw.full(h, value=FINAL_NORM_SCALE - 1.0)
    return tensors


ARCH = Architecture("gemma2", SIZES, hf_config, init_weights)
