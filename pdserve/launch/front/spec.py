"""The front as the launcher plans it: one more process of a deployment, started last, stopped first."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from pdserve.launch.instance import HOST
from pdserve.launch.process import ProcessSpec

DRAIN_GRACE_S = 5.0  # beyond its drain timeout, how long the launcher waits for the front to exit


@dataclass(frozen=True)
class FrontSpec:
    """A front on `port` forwarding to `upstream` (name, URL: the router, or the only instance);
    GET /v1/models is asked of `model_sources` (instance name, URL) in order.
    `drain_timeout`: after SIGTERM, how long requests in flight may take."""

    port: int
    upstream: tuple[str, str]
    model_sources: tuple[tuple[str, str], ...]
    drain_timeout: float = 30.0
    name: str = "front"

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def process_spec(self, run_dir: Path) -> ProcessSpec:
        argv = [sys.executable, "-m", "pdserve.launch.front", "--host", HOST, "--port", str(self.port),
                "--upstream", "=".join(self.upstream), "--drain-timeout", str(self.drain_timeout)]
        for source in self.model_sources:
            argv += ["--models-from", "=".join(source)]
        return ProcessSpec(self.name, tuple(argv), {}, run_dir / f"{self.name}.log", f"{self.url}/health")
