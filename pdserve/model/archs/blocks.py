"""Weight groups several architectures share, drawn in a fixed order."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from pdserve.model.archs.base import Tensors
from pdserve.model.scales import BASE_STD, EMBED_STD, LM_HEAD_STD, QK_STD
from pdserve.model.spec import ModelSpec

if TYPE_CHECKING:
    from pdserve.model.weights import WeightDraw


def attention(draw: WeightDraw, prefix: str, spec: ModelSpec, q_outputs_per_head: int = 1) -> Tensors:
    """q/k/v/o projections of grouped-query attention; `q_outputs_per_head` 2 adds an output gate per head."""
    h, q_dim, kv_dim = spec.hidden_size, spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    return {
        prefix + "q_proj.weight": draw.normal(q_outputs_per_head * q_dim, h, std=QK_STD),
        prefix + "k_proj.weight": draw.normal(kv_dim, h, std=QK_STD),
        prefix + "v_proj.weight": draw.normal(kv_dim, h, std=BASE_STD),
        prefix + "o_proj.weight": draw.normal(h, q_dim, std=BASE_STD),
    }


def gated_mlp(draw: WeightDraw, prefix: str, hidden_size: int, intermediate_size: int) -> Tensors:
    return {
        prefix + "gate_proj.weight": draw.normal(intermediate_size, hidden_size, std=BASE_STD),
        prefix + "up_proj.weight": draw.normal(intermediate_size, hidden_size, std=BASE_STD),
        prefix + "down_proj.weight": draw.normal(hidden_size, intermediate_size, std=BASE_STD),
    }


def pre_norm_decoder(draw: WeightDraw, spec: ModelSpec,
                     attention_of: Callable[[WeightDraw, str, ModelSpec], Tensors]) -> Tensors:
    """Embedding, per layer `attention_of`'s projections, a gated MLP and two unit RMS norms, the final
    norm and an untied lm_head: Llama's layout, which DeepSeek-V2's dense layers share."""
    h = spec.hidden_size
    tensors = {"model.embed_tokens.weight": draw.normal(spec.vocab_size, h, std=EMBED_STD)}
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        tensors |= attention_of(draw, p + "self_attn.", spec)
        tensors |= gated_mlp(draw, p + "mlp.", h, spec.intermediate_size)
        tensors[p + "input_layernorm.weight"] = draw.full(h, value=1.0)
        tensors[p + "post_attention_layernorm.weight"] = draw.full(h, value=1.0)
    tensors["model.norm.weight"] = draw.full(h, value=1.0)
    tensors["lm_head.weight"] = draw.normal(spec.vocab_size, h, std=LM_HEAD_STD)
    return tensors
