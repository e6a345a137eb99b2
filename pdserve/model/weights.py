"""Seeded random weights for a Llama model, scaled so that greedy decoding is not degenerate.

With the usual init (std 0.02 everywhere) the logits of a random model are nearly flat: top-1 and
top-2 are within a few hundredths at most steps, so two correct runs part at ties. Here lm_head
gets a larger std (logits with a spread of a few nats) and q/k a larger std (attention that
prefers some positions), so continuations depend on the whole prompt and ties are rare.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file

from pdserve.model.spec import ModelSpec

BASE_STD = 0.02
QK_STD = 0.05
EMBED_STD = 0.02
LM_HEAD_STD = 0.15


def init_weights(spec: ModelSpec, seed: int) -> dict[str, torch.Tensor]:
    """All tensors of LlamaForCausalLM (untied lm_head) in bf16, drawn in a fixed order."""
    gen = torch.Generator().manual_seed(seed)
    h, q_dim, kv_dim, ff = spec.hidden_size, spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim, spec.intermediate_size

    def normal(rows: int, cols: int, std: float) -> torch.Tensor:
        return (torch.randn(rows, cols, generator=gen) * std).to(torch.bfloat16)

    tensors = {"model.embed_tokens.weight": normal(spec.vocab_size, h, EMBED_STD)}
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        tensors[p + "self_attn.q_proj.weight"] = normal(q_dim, h, QK_STD)
        tensors[p + "self_attn.k_proj.weight"] = normal(kv_dim, h, QK_STD)
        tensors[p + "self_attn.v_proj.weight"] = normal(kv_dim, h, BASE_STD)
        tensors[p + "self_attn.o_proj.weight"] = normal(h, q_dim, BASE_STD)
        tensors[p + "mlp.gate_proj.weight"] = normal(ff, h, BASE_STD)
        tensors[p + "mlp.up_proj.weight"] = normal(ff, h, BASE_STD)
        tensors[p + "mlp.down_proj.weight"] = normal(h, ff, BASE_STD)
        tensors[p + "input_layernorm.weight"] = torch.ones(h, dtype=torch.bfloat16)
        tensors[p + "post_attention_layernorm.weight"] = torch.ones(h, dtype=torch.bfloat16)
    tensors["model.norm.weight"] = torch.ones(h, dtype=torch.bfloat16)
    tensors["lm_head.weight"] = normal(spec.vocab_size, h, LM_HEAD_STD)
    return tensors


def save(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """safetensors with fixed metadata: same tensors -> same bytes."""
    save_file({k: v.contiguous() for k, v in sorted(tensors.items())}, str(path), metadata={"format": "pt"})
