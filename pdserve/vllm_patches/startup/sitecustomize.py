"""Run by Python at the start of every process that has this directory on its PYTHONPATH: the
processes a vLLM started through pdserve's vLLM entry spawns (pdserve.vllm_cli puts this directory
first on their PYTHONPATH where it left some out), and the `nixl` mode's instances (launch/nixl_mode.py
puts it there for them). vLLM inspects a model in a subprocess of its own (`python -m
vllm.model_executor.models.registry`), which imports transformers, and with it torchvision, before
any plugin could run. Hides the torch extension packages the parent found broken
(pdserve.vllm_patches.torch_extensions), installs the NixlConnector CPU workarounds where their
variables are set (pdserve.vllm_patches.nixl_cpu), then runs the `sitecustomize` this one shadows,
if there is one. Python imports one module named `sitecustomize` per process: this is pdserve's."""

import importlib
import os
import sys
from pathlib import Path

from pdserve.vllm_patches import nixl_cpu
from pdserve.vllm_patches.torch_extensions import HIDDEN_ENV, hide

DIRECTORY = Path(__file__).resolve().parent


def _run_the_shadowed_one() -> None:
    ours = sys.modules.pop("sitecustomize", None)
    saved = list(sys.path)
    sys.path[:] = [p for p in sys.path if str(p) != str(DIRECTORY)]
    try:
        importlib.import_module("sitecustomize")
    except ImportError:
        pass
    finally:
        sys.path[:] = saved
        if ours is not None:
            sys.modules["sitecustomize"] = ours


hide(os.environ.get(HIDDEN_ENV, "").split(","))
nixl_cpu.install()
_run_the_shadowed_one()
