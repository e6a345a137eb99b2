"""The architectures `pdserve make-model --arch` builds, by name."""

from __future__ import annotations

from pdserve.errors import ConfigError
from pdserve.model.archs import deepseek_v2, gemma2, llama, mistral, nemotron_h, qwen3_next
from pdserve.model.archs.base import Architecture

ARCHS: dict[str, Architecture] = {a.name: a for a in (llama.ARCH, mistral.ARCH, gemma2.ARCH, qwen3_next.ARCH,
                                                      nemotron_h.ARCH, deepseek_v2.ARCH)}
DEFAULT_ARCH = "llama"


def arch_for(name: str) -> Architecture:
    try:
        return ARCHS[name]
    except KeyError:
        raise ConfigError(f"--arch: one of {', '.join(ARCHS)} (got {name!r})") from None


def builtin_models() -> dict[str, tuple[str, str]]:
    """Model names built on first use: a size (Llama) or ARCH-SIZE, mapped to (arch, size)."""
    names = {size: (DEFAULT_ARCH, size) for size in ARCHS[DEFAULT_ARCH].sizes}
    return names | {f"{name}-{size}": (name, size) for name, family in ARCHS.items() if name != DEFAULT_ARCH
                    for size in family.sizes}
