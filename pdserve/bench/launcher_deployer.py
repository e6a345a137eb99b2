"""The real deployer: the one place that tells same-host configurations from two-host ones."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Iterator

from pdserve import launch
from pdserve.bench.deployment import BENCH_PORT, DeploymentRequest, Endpoint, expect_model
from pdserve.bench.two_host_deployment import two_host_deployment, two_host_unavailable
from pdserve.launch import known_modes


class LauncherDeployer:
    """The real deployer: `pdserve.launch` modes, brought up from code on ``port`` and the next few."""

    def __init__(self, port: int = BENCH_PORT, startup_timeout_s: float = 600.0) -> None:
        self.port = port
        self.startup_timeout_s = startup_timeout_s

    def unavailable(self, config: str) -> str | None:
        request = DeploymentRequest(config, Path("."), Path("."))
        if request.two_host:
            return two_host_unavailable()
        mode = request.mode
        modes = known_modes()
        if mode not in modes:
            return f"launcher mode {mode!r} is not available (available: {', '.join(modes)})"
        return None

    def up(self, request: DeploymentRequest) -> contextlib.AbstractContextManager[Endpoint]:
        if request.two_host:
            return two_host_deployment(request, self.port, self.startup_timeout_s)
        return self._same_host(request)

    @contextlib.contextmanager
    def _same_host(self, request: DeploymentRequest) -> Iterator[Endpoint]:
        cluster = launch.up(request.up_options(self.port, self.startup_timeout_s))
        try:
            cluster.wait_healthy(self.startup_timeout_s)
            # PD routers do not all answer /v1/models: ask an instance which model is served.
            instance_url = next(iter(cluster.instance_urls.values()))
            yield Endpoint(cluster.endpoint, expect_model(instance_url, request.model_dir),
                           tuple(cluster.instance_urls.values()))
        finally:
            cluster.stop()
