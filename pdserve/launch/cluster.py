"""The lifecycle of one launch: start its processes, wait until healthy, supervise, stop them all.

    cluster = Cluster(deployment, restart="on-failure"); cluster.start(); cluster.wait_healthy(600)
    ... cluster.endpoint, cluster.instance_urls, cluster.restarts, cluster.failure ...
    cluster.stop()            # also on any failure of start/wait_healthy, and in __exit__

A death during start fails the start. Once healthy, a Supervisor watches the processes: with
restart "on-failure" it restarts a dead one (same spec, backoff); with "never" (the default for a
Cluster built directly, so callers that kill instances on purpose see them stay dead) it records
the first death in `failure`. Every child runs in its own session; stop() ends the supervisor,
drains the front (it refuses new requests and waits for those in flight, up to its drain
timeout), signals each process group (SIGTERM, deadline, SIGKILL) and removes the run directory
(ipc sockets, temp files, and the logs unless `log_dir` holds them), so nothing else is left.

Start order: instances; the router with them (discovery) or once they are healthy (static URLs);
the front once everything behind it is healthy. Stop order: the front, then all the rest at once.
"""

from __future__ import annotations

import dataclasses
import logging
import shutil
import signal
import tempfile
import time
from pathlib import Path

from pdserve.errors import LaunchError
from pdserve.launch.env import private_dir, runs_dir
from pdserve.launch.front_spec import DRAIN_GRACE_S, FrontSpec
from pdserve.launch.instance import InstanceSpec
from pdserve.launch.modes import Deployment
from pdserve.launch.options import RestartPolicy, check_restart_policy
from pdserve.launch.ports import require_free
from pdserve.launch.process import ManagedProcess, ProcessSpec
from pdserve.launch.router import RouterSpec
from pdserve.launch.supervisor import Supervisor

logger = logging.getLogger(__name__)

STOP_TIMEOUT = 30.0


class Cluster:
    """A running deployment: its instances (and router), health, endpoint, and clean stop.

    `log_dir`: where the processes write their logs, kept after stop (else in the run dir, removed).
    """

    def __init__(self, deployment: Deployment, log_dir: Path | None = None, restart: RestartPolicy = "never",
                 startup_timeout: float = 600.0) -> None:
        check_restart_policy(restart)
        self.deployment = deployment
        self.log_dir = log_dir
        self.restart = restart
        self.startup_timeout = startup_timeout  # also the deadline of a restarted process's health
        self.run_dir: Path | None = None
        self.instances: list[ManagedProcess] = []
        self.router: ManagedProcess | None = None
        self.front: ManagedProcess | None = None
        self.supervisor: Supervisor | None = None
        self.failure_log: list[str] = []
        self._state = "new"  # new -> starting -> healthy -> stopped

    @property
    def endpoint(self) -> str:
        """Base URL clients use (OpenAI API under /v1)."""
        return self.deployment.endpoint

    @property
    def instance_urls(self) -> dict[str, str]:
        """Each vLLM instance's own base URL, by instance name (for /metrics and direct requests)."""
        return {spec.name: spec.url for spec in self.deployment.instances}

    @property
    def processes(self) -> list[ManagedProcess]:
        """Every started process, in start order (instances, router, front)."""
        return [p for p in (*self.instances, self.router, self.front) if p is not None]

    @property
    def restarts(self) -> dict[str, int]:
        """How often each process (instances and router, by name) was restarted since healthy."""
        if self.supervisor is None:
            return {p.name: 0 for p in self.processes}
        return self.supervisor.restarts

    @property
    def failure(self) -> str | None:
        """Once healthy: the first death the supervisor could not or must not repair (None if none)."""
        return self.supervisor.failure if self.supervisor else None

    def start(self) -> None:
        """Check ports, create the run dir and start the instances (and a router that does not wait)."""
        self._expect("new")
        self._state = "starting"
        try:
            require_free(self.deployment.ports)
            scratch = private_dir(runs_dir())
            self.run_dir = Path(tempfile.mkdtemp(prefix=f"{self.deployment.client_port}-", dir=scratch))
            if self.log_dir is not None:
                self.log_dir.mkdir(parents=True, exist_ok=True)
                for spec in (*self.deployment.instances, self.deployment.router, self.deployment.front):
                    if spec is not None:  # a reused log dir: this launch's logs start empty
                        self._process_spec(spec).log_path.unlink(missing_ok=True)
            for spec in self.deployment.instances:
                process = ManagedProcess(self._process_spec(spec))
                self.instances.append(process)
                process.start()
            router = self.deployment.router
            if router and not router.start_after_instances:
                self._start_router()
        except BaseException:
            self.stop()
            raise

    def wait_healthy(self, timeout: float) -> None:
        """Block until every process answers its health check; on death or deadline stop all and raise."""
        self._expect("starting")
        deadline = time.monotonic() + timeout
        try:
            while True:
                self._check_alive()
                pending = [p for p in self.processes if not p.healthy()]
                if not pending and self.router is None and self.deployment.router is not None:
                    self._start_router()
                    continue
                if not pending and self.front is None and self.deployment.front is not None:
                    self.front = self._start(self.deployment.front)
                    continue
                if not pending:
                    self._state = "healthy"
                    self.supervisor = Supervisor(self.processes, self.restart, self.startup_timeout)
                    self.supervisor.start()
                    return
                if time.monotonic() > deadline:
                    names = ", ".join(p.name for p in pending)
                    raise LaunchError(f"{names} not healthy after {timeout:.0f} s ({self._last_error(pending[0])})")
                time.sleep(0.5)
        except BaseException:
            self.stop()
            raise

    def stop(self, timeout: float = STOP_TIMEOUT) -> None:
        """Drain the front, stop every other process (router first) by `timeout` seconds after the
        drain, and remove the run dir. Idempotent."""
        if self._state == "stopped":
            return
        self._state = "stopped"
        try:
            if self.supervisor is not None:
                self.supervisor.stop(time.monotonic() + timeout)  # first: no restart may race the stop below
            self._drain_front()
            deadline = time.monotonic() + timeout
            for process in reversed(self.processes):
                process.signal_group(signal.SIGTERM)  # SIGTERM all at once, then wait for each
            for process in reversed(self.processes):
                process.stop(deadline)
        finally:
            self._remove_run_dir()

    def log_path(self, name: str) -> Path:
        """Where the process `name` writes its log (in `log_dir` when there is one, else the run dir)."""
        assert self.run_dir is not None
        return (self.log_dir or self.run_dir) / f"{name}.log"

    def _remove_run_dir(self) -> None:
        if self.run_dir is not None:
            shutil.rmtree(self.run_dir, ignore_errors=True)

    def _process_spec(self, spec: InstanceSpec | RouterSpec | FrontSpec) -> ProcessSpec:
        """The spec's process, its log in `log_dir` when there is one (kept), else in the run dir."""
        assert self.run_dir is not None
        process = spec.process_spec(self.run_dir)
        if self.log_dir is None:
            return process
        return dataclasses.replace(process, log_path=self.log_dir / f"{process.name}.log")

    def __enter__(self) -> Cluster:
        if self._state == "new":
            self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def _drain_front(self) -> None:
        """SIGTERM the front alone and give it its drain timeout (and a grace) to exit: requests in
        flight finish while everything behind the front still runs."""
        if self.front is None or not self.front.alive():
            return
        assert self.deployment.front is not None
        drain_timeout = self.deployment.front.drain_timeout
        logger.info("pdserve: draining: new requests refused, those in flight get up to %.0f s", drain_timeout)
        self.front.stop(time.monotonic() + drain_timeout + DRAIN_GRACE_S)

    def _start_router(self) -> None:
        assert self.deployment.router is not None
        self.router = self._start(self.deployment.router)

    def _start(self, spec: RouterSpec | FrontSpec) -> ManagedProcess:
        process = ManagedProcess(self._process_spec(spec))
        process.start()
        return process

    def _check_alive(self) -> None:
        for process in self.processes:
            code = process.exit_code()
            if code is not None:
                raise LaunchError(f"{process.name} exited with code {code} during start: {self._last_error(process)}")

    def _last_error(self, process: ManagedProcess) -> str:
        tail = process.log_tail(200)
        self.failure_log = [f"--- {process.name} log tail", *tail[-40:]]
        return process.last_error(tail)

    def _expect(self, state: str) -> None:
        if self._state != state:
            raise LaunchError(f"cluster is {self._state}, expected {state}")
