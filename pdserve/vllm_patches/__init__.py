"""pdserve's patches to the vLLM it ships, installed in every vLLM process by the plugin entry point
(connector/plugin.py), so that a plain `vllm serve` in pdserve's environment is patched alike and
collocated serving stays the baseline PD is compared with. Each patch checks that vLLM's code is the
code it was written for, and otherwise leaves it alone with a warning.

- `seeded_sampling`: seeded requests on CPU survive a chunked prompt (vLLM's generator rewind fits
  GPU generators only).
- `cpu_rope`: the CPU rotary kernel rotates MLA's 3-D query and key correctly (DeepSeek-style models
  were served wrong on CPU).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys

from pdserve.vllm_patches import cpu_rope, seeded_sampling

PATCHES = (seeded_sampling, cpu_rope)


def install() -> None:
    """Patch each target module now if it is imported, else when vLLM imports it.

    Called by the plugin entry point in every vLLM process (API server, engine core, workers);
    idempotent. A process that never imports a target module is left as it was.
    """
    waiting = {}
    for patch in PATCHES:
        module = sys.modules.get(patch.MODULE)
        if module is not None:
            patch.patch(module)
        else:
            waiting[patch.MODULE] = patch.patch
    for finder in sys.meta_path:
        if isinstance(finder, _PatchOnImport):
            waiting = {name: fn for name, fn in waiting.items() if name not in finder.pending}
    if waiting:
        sys.meta_path.insert(0, _PatchOnImport(waiting))


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
