"""One vLLM server of a launch: what to run (InstanceSpec) and how it becomes a process."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

from pdserve.launch.arguments import is_hub_id
from pdserve.launch.cores import omp_threads_bind
from pdserve.launch.env import vllm_env
from pdserve.launch.process import ProcessSpec
from pdserve.launch.shm_namespace import confine, tmpfs_bytes
from pdserve.model.archs import builtin_models

HOST = "127.0.0.1"
SERVED_NAME_FLAG = "--served-model-name"


def served_name_args(model: str) -> tuple[str, ...]:
    """vLLM's flag that serves a built-in model (tiny, small, ...) under the name given to `--model`,
    as `vllm serve` names a model by its argument; vLLM would name it by the directory it was built
    in. A directory or a Hugging Face id needs none. Placed before the user's flags, so that a
    `--served-model-name` among those wins."""
    return (SERVED_NAME_FLAG, model) if model in builtin_models() else ()


@dataclass(frozen=True)
class InstanceSpec:
    """A `vllm serve` process.

    role: "both" (plain vLLM), "prefill" or "decode" - informative; a mode puts the role's
    connector flags in extra_args/extra_env. cores: CPUs to pin the process to (taskset), divided
    among its `tp` tensor-parallel ranks for their OpenMP threads (VLLM_CPU_OMP_THREADS_BIND, see
    cores.omp_threads_bind). shm_limit_bytes: size of the instance's private /dev/shm (the KV cache of
    every rank plus vLLM's own segments; see shm_namespace).
    """

    name: str
    role: str
    port: int
    model: str
    cores: tuple[int, ...]
    vllm_args: tuple[str, ...] = ()
    extra_args: tuple[str, ...] = ()
    extra_env: dict[str, str] = field(default_factory=dict)
    shm_limit_bytes: int = tmpfs_bytes(1 << 30)
    tp: int = 1

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    @property
    def cpu_binding(self) -> str:
        """Each rank's cores, '|' between ranks (VLLM_CPU_OMP_THREADS_BIND)."""
        return omp_threads_bind(self.cores, self.tp)

    def process_spec(self, run_dir: Path) -> ProcessSpec:
        """The command line and environment, with scratch files under run_dir/<name>/, in a private
        /dev/shm where the machine allows it (else its leftovers are swept after it stops)."""
        parallel = ("--tensor-parallel-size", str(self.tp)) if self.tp > 1 else ()
        argv = ("taskset", "-c", ",".join(map(str, self.cores)), sys.executable, "-m", "pdserve.vllm_cli", "serve",
                self.model, "--host", HOST, "--port", str(self.port), *parallel, *self.vllm_args, *self.extra_args)
        confined = confine(argv, self.shm_limit_bytes)
        env = {
            **vllm_env(run_dir / self.name, offline=not is_hub_id(self.model)),
            "VLLM_CPU_OMP_THREADS_BIND": self.cpu_binding,
            "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
            **self.extra_env,
        }
        return ProcessSpec(self.name, confined.argv, env, run_dir / f"{self.name}.log", f"{self.url}/health",
                           sweep_shm=confined.sweep_shm)
