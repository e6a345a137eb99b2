"""Seeded random tensors and their deterministic safetensors file."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file


class WeightDraw:
    """bf16 tensors drawn from one seeded generator in call order: same seed, same calls -> same tensors."""

    def __init__(self, seed: int) -> None:
        self._generator = torch.Generator().manual_seed(seed)

    def normal(self, *shape: int, std: float) -> torch.Tensor:
        return (torch.randn(*shape, generator=self._generator) * std).to(torch.bfloat16)

    def uniform(self, *shape: int, low: float, high: float) -> torch.Tensor:
        return (torch.rand(*shape, generator=self._generator) * (high - low) + low).to(torch.bfloat16)

    @staticmethod
    def full(*shape: int, value: float) -> torch.Tensor:
        return torch.full(shape, value, dtype=torch.bfloat16)


def save(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """safetensors with fixed metadata: same tensors -> same bytes."""
    save_file({k: v.contiguous() for k, v in sorted(tensors.items())}, str(path), metadata={"format": "pt"})
