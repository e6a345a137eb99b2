"""Keeps a healthy cluster's processes running: a thread that notices a death and restarts it.

    supervisor = Supervisor(processes, "on-failure", startup_timeout=600); supervisor.start()
    ... supervisor.restarts["decode"], supervisor.failure ...
    supervisor.stop(deadline)   # before the cluster stops its processes

Each process is in one of three states, changed only in `_step`:

    RUNNING  --dies-->  WAITING (backoff)  --delay passed-->  STARTING  --healthy-->  RUNNING
                                                  ^               |
                                                  +--dies, or not healthy by the startup deadline

With restart "never" the first death is recorded in `failure` and nothing is restarted; whoever
owns the cluster decides what to do (`pdserve up` tears everything down and exits non-zero).
A restart that cannot even spawn is recorded the same way.

The thread that respawns a process must outlive it: children get PR_SET_PDEATHSIG from the thread
that started them, so the thread runs until stop() and the cluster stops the processes after it.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

from pdserve.launch.backoff import Backoff, BackoffPolicy
from pdserve.launch.options import RestartPolicy, check_restart_policy
from pdserve.launch.process import ManagedProcess

logger = logging.getLogger(__name__)

POLL_S = 0.5
CLEANUP_S = 10.0  # what is left of a dead process's group gets this long after SIGTERM


class State(enum.Enum):
    RUNNING = "running"
    WAITING = "waiting"
    STARTING = "starting"


@dataclass
class Watch:
    """The supervisor's view of one process."""

    process: ManagedProcess
    backoff: Backoff
    state: State = State.RUNNING
    due: float = 0.0  # WAITING: when to start it; STARTING: when to give up on its health
    restarts: int = 0
    last_exit: int | None = None


class Supervisor:
    """Polls every POLL_S seconds; restarts dead processes with backoff, or records the first death."""

    def __init__(self, processes: Sequence[ManagedProcess], policy: RestartPolicy, startup_timeout: float,
                 backoff: BackoffPolicy = BackoffPolicy()) -> None:
        check_restart_policy(policy)
        self.policy = policy
        self.startup_timeout = startup_timeout
        self.failure: str | None = None
        self._watches = [Watch(p, Backoff(backoff)) for p in processes]
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pdserve-supervisor", daemon=True)

    @property
    def restarts(self) -> dict[str, int]:
        """Restarts so far, by process name."""
        return {w.process.name: w.restarts for w in self._watches}

    def states(self) -> dict[str, State]:
        return {w.process.name: w.state for w in self._watches}

    def start(self) -> None:
        """Begin watching; every process must be healthy now."""
        now = time.monotonic()
        for watch in self._watches:
            watch.backoff.healthy(now)
        self._thread.start()

    def stop(self, deadline: float) -> None:
        """End the thread (a pending restart is dropped, one being spawned finishes first).
        The processes keep running: stopping them is the caller's job."""
        self._stopping.set()
        if self._thread.is_alive():
            self._thread.join(max(0.0, deadline - time.monotonic()))
        if self._thread.is_alive():  # still cleaning up a dead group; it re-checks before spawning
            logger.warning("pdserve: supervisor still busy at its stop deadline; stopping the processes anyway")

    def _run(self) -> None:
        while not self._stopping.wait(POLL_S):
            for watch in self._watches:
                if self._stopping.is_set() or self.failure is not None:
                    break
                try:
                    self._step(watch, time.monotonic())
                except Exception as exc:  # the thread's boundary: it must live on (see the docstring)
                    logger.debug("supervisor step failed", exc_info=True)
                    self._fail(f"{watch.process.name} could not be restarted: {exc}")

    def _step(self, watch: Watch, now: float) -> None:
        """One look at one process: the only place its state changes."""
        process = watch.process
        if watch.state is State.WAITING:
            if now >= watch.due:
                self._restart(watch, now)
            return
        code = process.exit_code()
        if code is None and watch.state is State.STARTING and now > watch.due:
            logger.warning("pdserve: %s not healthy %.0f s after restart %d; killing it", process.name,
                           self.startup_timeout, watch.restarts)
            process.stop(now)  # past its deadline: SIGTERM, then SIGKILL at once
            code = process.exit_code()
        if code is not None:
            self._died(watch, code, now)
        elif watch.state is State.STARTING and process.healthy():
            logger.info("pdserve: %s healthy again after restart %d", process.name, watch.restarts)
            watch.state = State.RUNNING
            watch.backoff.healthy(now)

    def _restart(self, watch: Watch, now: float) -> None:
        process = watch.process
        process.stop(now + CLEANUP_S)  # what is left of the dead one's group, and its /dev/shm
        if self._stopping.is_set():
            return  # the cluster is stopping: leave it down
        watch.restarts += 1
        process.respawn(now + CLEANUP_S, f"restart {watch.restarts} (previous exit code {watch.last_exit})")
        watch.state, watch.due = State.STARTING, time.monotonic() + self.startup_timeout

    def _died(self, watch: Watch, code: int, now: float) -> None:
        name, error = watch.process.name, watch.process.last_error()
        if self.policy == "never":
            self._fail(f"{name} exited with code {code}: {error}")
            return
        delay = watch.backoff.failed(now)
        watch.state, watch.due, watch.last_exit = State.WAITING, now + delay, code
        logger.warning("pdserve: %s exited with code %d (%s); restart %d in %.1f s", name, code, error,
                       watch.restarts + 1, delay)

    def _fail(self, message: str) -> None:
        """Record the first failure; the thread then idles until stop() (see the module docstring)."""
        if self.failure is None:
            self.failure = message
            logger.debug("pdserve: %s", message)  # the owner reports it (pdserve up: as its error)
