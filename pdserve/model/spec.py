"""Model sizes that `pdserve make-model` builds."""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.errors import ConfigError


@dataclass(frozen=True)
class ModelSpec:
    """Shape of a Llama-architecture model and its tokenizer's vocabulary."""

    name: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int = 4096

    @property
    def num_params(self) -> int:
        h, kv = self.hidden_size, self.num_kv_heads * self.head_dim
        attention = 2 * h * self.num_heads * self.head_dim + 2 * h * kv
        layer = attention + 3 * h * self.intermediate_size + 2 * h
        return self.num_layers * layer + 2 * self.vocab_size * h + h


SIZES: dict[str, ModelSpec] = {
    "tiny": ModelSpec("tiny", hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=64,
                      intermediate_size=768, vocab_size=4096),
    "small": ModelSpec("small", hidden_size=1024, num_layers=8, num_heads=16, num_kv_heads=4, head_dim=64,
                       intermediate_size=2816, vocab_size=8192),
}


def spec_for(size: str) -> ModelSpec:
    try:
        return SIZES[size]
    except KeyError:
        raise ConfigError(f"unknown model size {size!r} (known: {', '.join(SIZES)})") from None
