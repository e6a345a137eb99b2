"""pdserve's patches to the vLLM it ships, installed in every vLLM process by the plugin entry point
(connector/plugin.py), so that a plain `vllm serve` in pdserve's environment is patched alike and
collocated serving stays the baseline PD is compared with.

- `seeded_sampling`: seeded requests on CPU survive a chunked prompt (vLLM's generator rewind fits
  GPU generators only).
- `cpu_rope`: the CPU rotary kernel rotates MLA's 3-D query and key correctly (DeepSeek-style models
  were served wrong on CPU).
- `admission`: where either of those does not fit the vLLM it meets, refuses what it protects
  (seeded requests vLLM may split: HTTP 400; MLA models on CPU: at startup) and serves the rest.

Each patch checks that vLLM's code is the code it was written for; one that does not fit (a class,
method or module renamed or gone, other code) is left out with a warning that names the vLLM
version and the patch, never a crash, and pdserve refuses what it protects (admission.py). Where
nothing could refuse that request by request, the instance refuses to start (admission.PatchRefusal).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
from pathlib import Path

from pdserve.vllm_patches import admission, cpu_rope, seeded_sampling

PATCHES = (seeded_sampling, cpu_rope, admission)


def install() -> None:
    """Patch each target module now if it is imported, else when vLLM imports it; a patch whose
    module this vLLM does not have is left out at once (its `left_out`).

    Called by the plugin entry point in every vLLM process (API server, engine core, workers);
    idempotent. A process that never imports a target module is left as it was. Raises
    admission.PatchRefusal where this vLLM must not serve at all.
    """
    waiting = {}
    for patch in PATCHES:
        module = sys.modules.get(patch.MODULE)
        if module is not None:
            patch.patch(module)
        elif module_exists(patch.MODULE):
            waiting[patch.MODULE] = patch.patch
        else:
            patch.left_out(f"vLLM has no module {patch.MODULE}")
    for finder in sys.meta_path:
        if isinstance(finder, _PatchOnImport):
            waiting = {name: fn for name, fn in waiting.items() if name not in finder.pending}
    if waiting:
        sys.meta_path.insert(0, _PatchOnImport(waiting))


def module_exists(name: str) -> bool:
    """Whether module `name` is on the path, found without importing it or its packages."""
    top, *rest = name.split(".")
    try:
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        return False
    if spec is None:
        return False
    if not rest:
        return True
    for location in spec.submodule_search_locations or ():
        path = Path(location, *rest)
        if path.with_suffix(".py").is_file() or (path / "__init__.py").is_file():
            return True
    return False


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Finds each target module once on the path and patches it right after it has executed; leaves
    `sys.meta_path` when none is left."""

    def __init__(self, pending: dict):
        self.pending = dict(pending)

    def find_spec(self, fullname, path, target=None):
        patch = self.pending.pop(fullname, None)
        if patch is None:
            return None
        if not self.pending:
            sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_patch(module):
            exec_module(module)
            patch(module)

        spec.loader.exec_module = exec_then_patch
        return spec
