"""The supervisor on real (fake) server processes: restart with backoff, `never`, stop at any moment."""

import logging
import os
import re
import signal
import time

import pytest
import requests

from pdserve.errors import ConfigError
from pdserve.launch.backoff import BackoffPolicy
from pdserve.launch.cluster import Cluster
from pdserve.launch.modes import Deployment
from pdserve.launch.ports import port_free
from pdserve.launch.process import ManagedProcess, group_members
from pdserve.launch.supervisor import State, Supervisor
from tests.unit.launch.fakes import FakeInstance

BASE = 18920
FAST = BackoffPolicy(initial_s=0.2, factor=2, max_s=0.8, reset_after_s=60)


def wait_for(condition, timeout: float = 20, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what} not reached in {timeout} s"
        time.sleep(0.05)


def started(tmp_path, *instances: FakeInstance) -> list[ManagedProcess]:
    processes = [ManagedProcess(i.process_spec(tmp_path)) for i in instances]
    for p in processes:
        p.start()
    wait_for(lambda: all(p.healthy() for p in processes), what="healthy")
    return processes


@pytest.fixture
def processes():
    """Started processes of a test, stopped (and checked gone) after it."""
    started_ones: list[ManagedProcess] = []
    yield started_ones
    for p in started_ones:
        p.stop(time.monotonic() + 5)
        assert not p.alive()


def kill(process: ManagedProcess) -> int:
    pid = process.pid
    os.killpg(pid, signal.SIGKILL)
    return pid


def test_a_killed_process_comes_back_with_the_same_spec_and_the_others_keep_running(tmp_path, processes):
    processes += started(tmp_path, FakeInstance("a", BASE), FakeInstance("b", BASE + 1))
    a, b = processes
    supervisor = Supervisor(processes, "on-failure", startup_timeout=30, backoff=FAST)
    supervisor.start()
    try:
        old_a, old_b = kill(a), b.pid
        wait_for(lambda: supervisor.states()["a"] is State.RUNNING and supervisor.restarts["a"] == 1,
                 what="a restarted")
        assert a.pid != old_a and b.pid == old_b and group_members(old_a) == []
        assert requests.get(f"http://127.0.0.1:{BASE}/health", timeout=5).status_code == 200
        assert a.spec.argv == processes[0].spec.argv and supervisor.restarts == {"a": 1, "b": 0}
        assert "--- pdserve: restart 1 (previous exit code -9)" in a.log_tail()
    finally:
        supervisor.stop(time.monotonic() + 10)


def test_restarts_back_off_doubling_and_recover(tmp_path, processes, caplog):
    caplog.set_level(logging.INFO, logger="pdserve.launch.supervisor")
    override = tmp_path / "next-start"
    processes += started(tmp_path, FakeInstance("a", BASE + 2, override=override))
    supervisor = Supervisor(processes, "on-failure", startup_timeout=30, backoff=FAST)
    supervisor.start()
    try:
        override.write_text("die 0")  # every restart dies at once, printing an error
        kill(processes[0])
        wait_for(lambda: supervisor.restarts["a"] >= 4, what="four restarts")
        override.unlink()
        wait_for(lambda: supervisor.states()["a"] is State.RUNNING, what="recovery")
    finally:
        supervisor.stop(time.monotonic() + 10)
    lines = [r.getMessage() for r in caplog.records]
    delays = [float(m.group(1)) for line in lines if (m := re.search(r"restart \d+ in ([\d.]+) s", line))]
    assert delays[:4] == [0.2, 0.4, 0.8, 0.8]
    assert "a exited with code -9" in lines[0]
    assert any("a exited with code 3 (RuntimeError: boom while loading)" in line for line in lines)
    assert any(re.search(r"a healthy again after restart \d+", line) for line in lines)


def test_a_restart_that_never_becomes_healthy_is_killed_at_the_startup_deadline(tmp_path, processes, caplog):
    caplog.set_level(logging.WARNING, logger="pdserve.launch.supervisor")
    override = tmp_path / "next-start"
    processes += started(tmp_path, FakeInstance("a", BASE + 3, override=override))
    supervisor = Supervisor(processes, "on-failure", startup_timeout=1.0, backoff=FAST)
    supervisor.start()
    try:
        override.write_text("never-healthy 0")
        kill(processes[0])
        wait_for(lambda: supervisor.restarts["a"] >= 2, what="a second restart")
    finally:
        supervisor.stop(time.monotonic() + 10)
    assert any("a not healthy 1 s after restart 1; killing it" in r.getMessage() for r in caplog.records)


def test_never_records_the_first_death_and_restarts_nothing(tmp_path, processes):
    processes += started(tmp_path, FakeInstance("a", BASE + 4), FakeInstance("b", BASE + 5))
    supervisor = Supervisor(processes, "never", startup_timeout=30, backoff=FAST)
    supervisor.start()
    try:
        kill(processes[1])
        wait_for(lambda: supervisor.failure is not None, what="failure")
        assert supervisor.failure.startswith("b exited with code -9")
        time.sleep(1.0)  # longer than FAST's first delay
        assert supervisor.restarts == {"a": 0, "b": 0} and processes[1].exit_code() == -9
        assert processes[0].exit_code() is None
    finally:
        supervisor.stop(time.monotonic() + 10)


def test_an_unknown_policy_is_refused():
    with pytest.raises(ConfigError, match="unknown restart policy 'always'"):
        Supervisor([], "always", startup_timeout=1)
    with pytest.raises(ConfigError, match="unknown restart policy"):
        Cluster(Deployment(()), restart="sometimes")


@pytest.mark.parametrize("moment", ["restart pending", "restart mid-start"])
def test_cluster_stops_cleanly_while_a_restart_is_pending_or_starting(tmp_path, moment):
    override = tmp_path / "next-start"
    cluster = Cluster(Deployment((FakeInstance("a", BASE + 6, override=override), FakeInstance("b", BASE + 7))),
                      restart="on-failure", startup_timeout=60)
    cluster.start()
    try:
        cluster.wait_healthy(30)
        assert cluster.restarts == {"a": 0, "b": 0}
        a = cluster.instances[0]
        first = kill(a)
        if moment == "restart pending":  # default backoff: the first restart waits 1 s
            wait_for(lambda: cluster.supervisor.states()["a"] is State.WAITING, what="waiting")
        else:
            override.write_text("ok 30")  # the restarted one takes 30 s to listen
            wait_for(lambda: cluster.supervisor.states()["a"] is State.STARTING, what="starting")
        groups = [first, a.pid, cluster.instances[1].pid]
        start = time.monotonic()
    finally:
        cluster.stop()
    assert time.monotonic() - start < 5
    assert all(group_members(g) == [] for g in groups)
    time.sleep(1.5)  # a restart that was pending must not happen after stop
    assert all(group_members(g) == [] for g in (a.pid, cluster.instances[1].pid))
    assert port_free(BASE + 6) and port_free(BASE + 7) and not cluster.run_dir.exists()
    assert cluster.restarts["a"] == (0 if moment == "restart pending" else 1)
