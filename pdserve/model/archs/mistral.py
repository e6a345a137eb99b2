"""Mistral (`MistralForCausalLM`): Llama's layers, every one of them sliding-window."""

from __future__ import annotations

from dataclasses import asdict

from pdserve.model.archs import llama
from pdserve.model.archs.base import Architecture, SpecialTokens
from pdserve.model.spec import TINY, ModelSpec, SlidingWindowSpec

SIZES = {"tiny": SlidingWindowSpec(**asdict(TINY), sliding_window=128)}


def hf_config(spec: ModelSpec, tokens: SpecialTokens) -> dict:
    assert isinstance(spec, SlidingWindowSpec)
    return llama.hf_config(spec, tokens) | {
        "architectures": ["MistralForCausalLM"], "model_type": "mistral", "sliding_window": spec.sliding_window,
    }


ARCH = Architecture("mistral", SIZES, hf_config, llama.init_weights)
