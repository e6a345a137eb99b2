"""CPU workarounds for vLLM's NixlConnector, for the `nixl` mode's instances only.

`install()` runs at interpreter start-up in every Python process that has the children's
`sitecustomize` (startup/sitecustomize.py) on its PYTHONPATH; the `nixl` mode puts that directory
there for its two vLLM instances and sets the variables below for them and nowhere else, so every
other process installs nothing. Nothing in the venv is modified. Each patch is applied right after
its target module is imported, and only when its variable is set:

PDSERVE_NIXL_NO_AFFINITY=1
    vllm ...nixl/base_worker.py calls os.sched_setaffinity(0, [last core of each NUMA node]) from
    the worker's main thread, which is also the OpenMP compute thread: on a 2-core box P's model
    forward moves onto D's core. That module's `os` becomes a view of `os` whose
    sched_setaffinity does nothing; every other module keeps the real one.
PDSERVE_NIXL_PTHR_DELAY_US=<us>
    nixl_cu12._api.nixl_agent hardcodes agentConfig.pthrDelay = 0, so UCX's progress thread polls
    with a zero timeout and spins a whole core. Agents are created with this delay instead.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
import types

_AFFINITY_MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker"
_NIXL_API_MODULE = "nixl_cu12._api"


def _without_affinity(module: types.ModuleType) -> None:
    view = types.ModuleType("os")
    view.__dict__.update(os.__dict__)
    view.sched_setaffinity = lambda pid, cpus: None
    module.os = view


def _with_pthr_delay(module: types.ModuleType) -> None:
    delay_us = int(os.environ["PDSERVE_NIXL_PTHR_DELAY_US"])
    bindings = module.nixlBind
    real_agent = bindings.nixlAgent

    def agent(name, config):
        config.pthrDelay = delay_us
        return real_agent(name, config)

    view = types.ModuleType(bindings.__name__)
    view.__dict__.update(bindings.__dict__)
    view.nixlAgent = agent
    module.nixlBind = view


class _PatchAfterImport(importlib.abc.MetaPathFinder):
    def __init__(self, patches: dict) -> None:
        self.patches = patches

    def find_spec(self, fullname, path, target=None):
        patch = self.patches.get(fullname)
        if patch is None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return None
        exec_module = spec.loader.exec_module

        def exec_and_patch(module):
            exec_module(module)
            patch(module)

        spec.loader.exec_module = exec_and_patch
        return spec


def install() -> None:
    """Patch each target module whose variable is set, right after it is imported."""
    patches = {}
    if os.environ.get("PDSERVE_NIXL_NO_AFFINITY") == "1":
        patches[_AFFINITY_MODULE] = _without_affinity
    if os.environ.get("PDSERVE_NIXL_PTHR_DELAY_US"):
        patches[_NIXL_API_MODULE] = _with_pthr_delay
    if patches:
        sys.meta_path.insert(0, _PatchAfterImport(patches))
