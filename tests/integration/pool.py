"""The suite's shared deployments: each starts once, serves every module that names it, and stops
after its last test (vLLM's module-scoped `RemoteOpenAIServer`, shared across modules).

A module asks for one with `shared("pd-write", "pd-read")`: a module fixture parametrized by the
deployment's name. At collection (conftest.py) the tests of each deployment are put next to each
other, in file order, so a deployment runs through one stretch of the suite and the next one starts
after it stopped: with the session's collocated reference, at most two run at a time. A test that
kills part of a deployment leaves the rest to the pool: before the next module gets it, the pool
waits until the supervisor restarted what died and a request moves KV through the router again.
A module starts a deployment of its own only where its test is the start or the death of one.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from pdserve.bench.samples import metric
from pdserve.launch import Cluster
from pdserve.launch.supervisor import State
from tests.integration.pd_helpers import greedy, metrics, pd_pair

READY_DEADLINE_S = 600  # one more vLLM start on a loaded 2-core machine
NO_FAULTS = {"rules": []}


class DeploymentName(str):
    """A fixture parameter that names a shared deployment (so collection can tell it from others)."""


@dataclass(frozen=True)
class Spec:
    """What a shared deployment is: how to start it (a context manager yielding the running
    Cluster, which stops it and checks nothing is left) and its first port."""

    start: Callable[[], contextlib.AbstractContextManager[Cluster]]
    port: int


@contextlib.contextmanager
def _pd(mode: str, port: int) -> Iterator[Cluster]:
    """P and D with PDConnector behind vllm-router and the front, restarted on failure, with a
    fault plan the tests switch (`cluster.fault_plan`: no rules unless a test writes some)."""
    with tempfile.TemporaryDirectory(prefix="pdserve-plan-") as tmp:
        plan = Path(tmp) / "plan.json"
        plan.write_text(json.dumps(NO_FAULTS))
        with pd_pair(mode, port, front=True, restart="on-failure", test_fault_plan=str(plan)) as cluster:
            cluster.fault_plan = plan
            cluster.port = port
            yield cluster


SPECS: dict[str, Spec] = {
    "pd-write": Spec(lambda: _pd("write", 28100), 28100),
    "pd-read": Spec(lambda: _pd("read", 28200), 28200),
}


def shared(*names: str):
    """A module fixture giving each test the running deployment `names` (one parameter each)."""
    unknown = [n for n in names if n not in SPECS]
    assert not unknown, f"no shared deployment named {unknown}"

    @pytest.fixture(scope="module", params=[DeploymentName(n) for n in names], ids=list(names))
    def deployment(request):
        return request.config.stash[POOL].get(request.param)
    return deployment


def deployment_of(item: pytest.Item) -> str | None:
    """The shared deployment a collected test uses, if any."""
    callspec = getattr(item, "callspec", None)
    names = [v for v in (callspec.params.values() if callspec else ()) if isinstance(v, DeploymentName)]
    return str(names[0]) if names else None


class DeploymentPool:
    """The running shared deployments. `plan` tells it, after collection, the index of each
    deployment's last test; `finished(index)` stops those whose last test has run."""

    def __init__(self) -> None:
        self._stack: dict[str, contextlib.ExitStack] = {}
        self._running: dict[str, Cluster] = {}
        self._restarts: dict[str, int] = {}
        self._last_use: dict[str, int] = {}

    def plan(self, last_use: dict[str, int]) -> None:
        self._last_use = dict(last_use)

    def get(self, name: str) -> Cluster:
        if name not in self._running:
            for other in list(self._running):  # grouped at collection: the previous one is done with
                self._stop(other)
            stack = contextlib.ExitStack()
            self._running[name] = stack.enter_context(SPECS[name].start())
            self._stack[name] = stack
        cluster = self._running[name]
        self._ready(cluster)
        self._restarts[name] = sum(cluster.restarts.values())
        return cluster

    def finished(self, index: int) -> None:
        for name in [n for n in self._running if self._last_use.get(n, -1) <= index]:
            self._stop(name)

    def close(self) -> None:
        errors = []
        for name in list(self._running):
            try:
                self._stop(name)
            except Exception as exc:  # stop the others too; report every failure
                errors.append(f"{name}: {exc}")
        assert not errors, errors

    def _stop(self, name: str) -> None:
        self._running.pop(name)
        self._restarts.pop(name, None)
        self._stack.pop(name).close()

    def _ready(self, cluster: Cluster) -> None:
        """No fault rules; every process running; and, if one was restarted since the last module,
        KV moving to D through the router again (the front routes around an instance until its
        probe sees it, the router until it registers)."""
        cluster.fault_plan.write_text(json.dumps(NO_FAULTS))
        deadline = time.monotonic() + READY_DEADLINE_S
        while any(state is not State.RUNNING for state in cluster.supervisor.states().values()):
            assert cluster.failure is None, cluster.failure
            assert time.monotonic() < deadline, f"not back: {cluster.supervisor.states()}"
            time.sleep(1)
        name = next(n for n, c in self._running.items() if c is cluster)
        if self._restarts.get(name, 0) != sum(cluster.restarts.values()):
            wait_disaggregated(cluster, deadline)


def kill(cluster: Cluster, name: str) -> int:
    """SIGKILL the process group of instance `name` (the supervisor restarts it); its old pid."""
    pid = next(p for p in cluster.instances if p.name == name).pid
    os.killpg(pid, signal.SIGKILL)
    return pid


def wait_back(cluster: Cluster, name: str, killed: int) -> None:
    """Until the supervisor restarted `name` (killed as pid `killed`) and KV moves to D again."""
    process = next(p for p in cluster.instances if p.name == name)
    deadline = time.monotonic() + READY_DEADLINE_S
    while not (process.pid != killed and cluster.supervisor.states()[name] is State.RUNNING):
        assert time.monotonic() < deadline, f"{name} not back: {cluster.supervisor.states()}"
        assert cluster.failure is None, cluster.failure
        time.sleep(1)
    wait_disaggregated(cluster, deadline)


def wait_disaggregated(cluster: Cluster, deadline: float) -> None:
    """Until a request through the endpoint moves KV to D (the front routes around an instance
    until its probe sees it, the router until it registers)."""
    probe = [list(range(100, 400))]  # a few blocks' KV to move
    while True:
        before = _kv_bytes(cluster.decode_url)
        with contextlib.suppress(Exception):
            greedy(cluster.endpoint, cluster, probe)
        if _kv_bytes(cluster.decode_url) > before >= 0:
            return
        assert time.monotonic() < deadline, "the router path never came back"
        time.sleep(1)


def _kv_bytes(url: str) -> float:
    """D's KV bytes received so far; -1 while it does not answer."""
    try:
        return metric(metrics(url), "pdserve:kv_transfer_bytes_total")
    except Exception:
        return -1.0


POOL = pytest.StashKey[DeploymentPool]()
