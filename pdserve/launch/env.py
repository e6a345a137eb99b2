"""Every environment variable pdserve hands to vLLM, in one place.

vLLM leaves zmq ipc sockets, `vllm_dist_*` files and compile caches in the system temp dir and
the home directory unless told otherwise. pdserve keeps persistent caches under
`<work-dir>/.cache/` (pdserve.paths) and per-process scratch (ipc sockets, temp files) in a
private scratch directory under the system's temp dir that the launcher deletes on stop; the
processes' logs stay in a run directory under `<work-dir>/runs/`. A local model runs offline; a Hugging Face id is left to vLLM and the
user's own Hugging Face cache and settings. Used by the launcher (`pdserve.launch.instance`) and
by the `vllm` wrapper (`pdserve.vllm_cli`).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from pdserve.errors import LaunchError
from pdserve.paths import work_dir


def cache_dir() -> Path:
    return work_dir() / ".cache"


def runs_dir() -> Path:
    """Parent of per-launch scratch directories, in the system's temp dir: a work directory's path
    can be too long for the ipc sockets inside (unix socket paths are limited to 107 bytes)."""
    return Path(tempfile.gettempdir()) / f"pdserve-{os.getuid()}"


def private_dir(path: Path) -> Path:
    """`path`, created if needed, refused unless this user owns it and only this user may enter it."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = path.stat()
    if info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise LaunchError(f"{path} belongs to someone else or is open to others: remove it or set TMPDIR")
    return path


def logs_root() -> Path:
    """Parent of each `pdserve up`'s run directory, which keeps its processes' logs."""
    return work_dir() / "runs"


def vllm_env(scratch_dir: Path | None = None, offline: bool = True) -> dict[str, str]:
    """Variables that keep vLLM's files inside the work directory and make it run on the CPU.

    `scratch_dir` receives ipc sockets and temp files; it defaults to `<cache>/tmp`. `offline`:
    the model is local, so nothing asks the Hugging Face hub; else the hub and the user's cache
    (HF_HOME, default ~/.cache/huggingface) serve the model.
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
        **(_offline(cache) if offline else _hub()),
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }


def _offline(cache: Path) -> dict[str, str]:
    return {"HF_HOME": str(cache / "hf"), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def _hub() -> dict[str, str]:
    home = os.environ.get("HF_HOME") or str(Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
                                            / "huggingface")
    return {"HF_HOME": home, "HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "0"),
            "TRANSFORMERS_OFFLINE": os.environ.get("TRANSFORMERS_OFFLINE", "0")}


def prepare(env: dict[str, str]) -> None:
    """Create the directories that `env` names."""
    for key in ("VLLM_RPC_BASE_PATH", "TMPDIR", "VLLM_CACHE_ROOT", "TORCHINDUCTOR_CACHE_DIR", "HF_HOME"):
        Path(env[key]).mkdir(parents=True, exist_ok=True)
