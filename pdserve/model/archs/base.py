"""What an architecture contributes to `pdserve make-model`: its sizes, its config.json and its weights.

An architecture module imports no torch at module level (the `pdserve` command lists them without
loading it); it builds tensors only through the `WeightDraw` it is handed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Mapping, NamedTuple

from pdserve.errors import ConfigError
from pdserve.model.spec import ModelSpec

if TYPE_CHECKING:
    import torch

    from pdserve.model.weights import WeightDraw

Tensors = dict[str, "torch.Tensor"]


class SpecialTokens(NamedTuple):
    bos: int
    eos: int
    pad: int


@dataclass(frozen=True)
class Architecture:
    """A model family vLLM maps to one of its model classes.

    `hf_config(spec, tokens)` returns config.json; `init_weights(spec, draw)` returns every tensor of
    the checkpoint under its Hugging Face name, drawing them in a fixed order.
    """

    name: str
    sizes: Mapping[str, ModelSpec]
    hf_config: Callable[[ModelSpec, SpecialTokens], dict]
    init_weights: Callable[[ModelSpec, WeightDraw], Tensors]

    def spec_for(self, size: str) -> ModelSpec:
        try:
            return self.sizes[size]
        except KeyError:
            raise ConfigError(f"--size: --arch {self.name} is built in {', '.join(self.sizes)} "
                              f"(got {size!r})") from None


def base_config(spec: ModelSpec, tokens: SpecialTokens) -> dict:
    """Keys every architecture's config.json has, whatever its family."""
    return {
        "torch_dtype": "bfloat16", "hidden_size": spec.hidden_size, "num_hidden_layers": spec.num_layers,
        "vocab_size": spec.vocab_size, "max_position_embeddings": spec.max_position_embeddings,
        "initializer_range": 0.02, "use_cache": True,
        "bos_token_id": tokens.bos, "eos_token_id": tokens.eos, "pad_token_id": tokens.pad,
    }
