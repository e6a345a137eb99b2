"""Shapes of the models `pdserve make-model` builds."""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_SEED = 0
MAX_SEED = 2**32 - 1


@dataclass(frozen=True)
class ModelSpec:
    """The shape every architecture shares: a decoder stack and its tokenizer's vocabulary."""

    name: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int = 4096


@dataclass(frozen=True)
class SlidingWindowSpec(ModelSpec):
    """A model whose sliding-window layers attend to the last `sliding_window` tokens only."""

    sliding_window: int = 128


SIZES: dict[str, ModelSpec] = {
    "tiny": ModelSpec("tiny", hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=64,
                      intermediate_size=768, vocab_size=4096),
    "small": ModelSpec("small", hidden_size=1024, num_layers=8, num_heads=16, num_kv_heads=4, head_dim=64,
                       intermediate_size=2816, vocab_size=8192),
}
TINY = SIZES["tiny"]
