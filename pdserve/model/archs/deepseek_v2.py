"""DeepSeek-V2 (`DeepseekV2ForCausalLM`): multi-head latent attention (MLA), dense MLPs."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from pdserve.model.archs import blocks
from pdserve.model.archs.base import Architecture, SpecialTokens, Tensors, base_config
from pdserve.model.scales import BASE_STD, QK_STD
from pdserve.model.spec import TINY, ModelSpec

if TYPE_CHECKING:
    from pdserve.model.weights import WeightDraw

# Queries and the latent (with its rotary key) are drawn wider than Llama's q/k: MLA divides scores by
# sqrt(qk_nope + qk_rope) and normalizes the latent, and with Llama's std attention over a long
# prompt flattens to its mean and greedy decoding repeats one token.
MLA_QK_STD = 2 * QK_STD


@dataclass(frozen=True)
class MlaSpec(ModelSpec):
    """MLA caches one latent per token and layer, shared by all heads: `kv_lora_rank` compressed
    KV plus `qk_rope_head_dim` rotary key, 576 values with the defaults (the head size vLLM's AMX
    MLA backend requires). `head_dim` is the rotary part, as in DeepSeek's own configs.

    What vLLM needs to serve it on CPU: with AMX, the AMX MLA backend (bf16, block size a multiple
    of 32); without, the reference MLA backend, which takes block size 16 and runs without chunked
    prefill or prefix caching (vLLM turns both off). The MLP of every layer is dense
    (`first_k_dense_replace` = number of layers): vLLM's model class accepts a model without MoE.
    """

    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 64
    qk_rope_head_dim: int = 64
    v_head_dim: int = 64


SIZES = {"tiny": MlaSpec(**asdict(TINY) | {"num_kv_heads": TINY.num_heads})}


def hf_config(spec: ModelSpec, tokens: SpecialTokens) -> dict:
    assert isinstance(spec, MlaSpec)
    return base_config(spec, tokens) | {
        "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2",
        "intermediate_size": spec.intermediate_size, "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads, "head_dim": spec.qk_rope_head_dim,
        "q_lora_rank": None, "kv_lora_rank": spec.kv_lora_rank, "qk_nope_head_dim": spec.qk_nope_head_dim,
        "qk_rope_head_dim": spec.qk_rope_head_dim, "v_head_dim": spec.v_head_dim,
        "hidden_act": "silu", "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "rope_scaling": None,
        "attention_bias": False, "attention_dropout": 0.0, "mlp_bias": False, "tie_word_embeddings": False,
        "first_k_dense_replace": spec.num_layers, "moe_layer_freq": 1, "n_routed_experts": 4,
        "n_shared_experts": 1, "num_experts_per_tok": 2, "moe_intermediate_size": 128,
        "topk_method": "greedy", "norm_topk_prob": False, "routed_scaling_factor": 1.0,
    }


def _mla(draw: WeightDraw, prefix: str, spec: MlaSpec) -> Tensors:
    h, heads = spec.hidden_size, spec.num_heads
    return {
        prefix + "q_proj.weight": draw.normal(heads * (spec.qk_nope_head_dim + spec.qk_rope_head_dim), h, std=MLA_QK_STD),
        prefix + "kv_a_proj_with_mqa.weight": draw.normal(spec.kv_lora_rank + spec.qk_rope_head_dim, h,
                                                          std=MLA_QK_STD),
        prefix + "kv_a_layernorm.weight": draw.full(spec.kv_lora_rank, value=1.0),
        prefix + "kv_b_proj.weight": draw.normal(heads * (spec.qk_nope_head_dim + spec.v_head_dim), spec.kv_lora_rank,
                                                 std=BASE_STD),
        prefix + "o_proj.weight": draw.normal(h, heads * spec.v_head_dim, std=BASE_STD),
    }


def init_weights(spec: ModelSpec, draw: WeightDraw) -> Tensors:
    assert isinstance(spec, MlaSpec)
    return blocks.pre_norm_decoder(draw, spec, _mla)


ARCH = Architecture("deepseek-v2", SIZES, hf_config, init_weights)
