"""vllm-router in front of a launch's instances."""

from __future__ import annotations

import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from pdserve.errors import LaunchError
from pdserve.launch.instance import HOST
from pdserve.launch.process import ProcessSpec
from pdserve.registrar import RegistrarSpec


def router_binary() -> str:
    local = Path(sys.executable).with_name("vllm-router")
    found = str(local) if local.exists() else shutil.which("vllm-router")
    if not found:
        raise LaunchError("vllm-router is not installed (run scripts/bootstrap.sh)")
    return found


@dataclass(frozen=True)
class RouterSpec:
    """A vllm-router process.

    worker_urls: plain (non-PD) workers; PD modes leave it empty and put `--vllm-pd-disaggregation
    ...` in extra_args. start_after_instances: start it once every instance answers /health
    (static workers); False starts it with the instances (discovery: instances register with it).
    registrar: discovery through pdserve's registrar, which then runs with the router as one
    process (registrar/) and gives the router its discovery flags.
    """

    port: int
    prometheus_port: int
    policy: str = "round_robin"
    worker_urls: tuple[str, ...] = ()
    extra_args: tuple[str, ...] = ()
    start_after_instances: bool = True
    health_path: str = "/health"
    name: str = "router"
    registrar: RegistrarSpec | None = None

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def process_spec(self, run_dir: Path) -> ProcessSpec:
        argv = [router_binary(), "--host", HOST, "--port", str(self.port), "--prometheus-host", HOST,
                "--prometheus-port", str(self.prometheus_port), "--policy", self.policy, "--log-level", "warning"]
        if self.worker_urls:
            argv += ["--worker-urls", *self.worker_urls]
        argv += self.extra_args
        if self.registrar is not None:
            argv = list(self.registrar.wrap(argv))
        return ProcessSpec(self.name, tuple(argv), {}, run_dir / f"{self.name}.log", f"{self.url}{self.health_path}")
