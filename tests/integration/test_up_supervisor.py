"""`pdserve up` survives an instance's death: on the shared write deployment (pool.py), the decode
instance's whole process group SIGKILLed; the supervisor restarts it (same ports, pinning, args, in a fresh private
/dev/shm), it re-registers with the router, and the next completion moves KV from P to the new D."""

import os
import signal
import time

import pytest
import requests

from pdserve.launch import UpOptions
from pdserve.launch.process import group_members
from pdserve.launch.supervisor import State
from tests.integration.pd_helpers import metric, metrics, model_name
from tests.integration.pool import shared

pytestmark = pytest.mark.integration

cluster = shared("pd-write")
RESTART_DEADLINE = 600  # one more vLLM start on a loaded 2-core machine


def completion(cluster) -> requests.Response | None:
    """One short completion through the router; None when the connection itself fails."""
    body = {"model": model_name(cluster), "prompt": "The river flows north and the mountain", "max_tokens": 8,
            "temperature": 0, "ignore_eos": True}
    try:
        return requests.post(f"{cluster.endpoint}/v1/completions", json=body, timeout=60)
    except requests.RequestException:
        return None


def wait_served(cluster, timeout: float) -> requests.Response:
    """Until a completion through the front answers 200."""
    deadline = time.monotonic() + timeout
    while True:
        response = completion(cluster)
        if response is not None and response.status_code == 200:
            return response
        assert time.monotonic() < deadline, f"no completion in {timeout} s: {response and response.text}"
        time.sleep(1)


def test_killed_decode_instance_is_restarted_and_serves_again(cluster):
    assert UpOptions().restart == "on-failure"  # the default, through code as on the command line
    assert cluster.restart == "on-failure"
    wait_served(cluster, 60)
    before = dict(cluster.restarts)
    decode = cluster.instances[1]
    assert decode.name == "decode"
    killed, affinity = decode.pid, os.sched_getaffinity(decode.pid)
    os.killpg(killed, signal.SIGKILL)
    deadline = time.monotonic() + RESTART_DEADLINE
    while not (decode.pid != killed and cluster.supervisor.states()["decode"] is State.RUNNING):
        assert time.monotonic() < deadline, f"decode not back: {cluster.supervisor.states()} {decode.log_tail()}"
        assert cluster.failure is None, cluster.failure
        time.sleep(1)
    assert group_members(killed) == []
    assert os.sched_getaffinity(decode.pid) == affinity  # same pinning
    deadline = time.monotonic() + 120
    while True:  # the front routes around D until its probe finds it up, then through the router again
        response = wait_served(cluster, 120)
        assert response.json()["usage"]["completion_tokens"] == 8
        if metric(metrics(cluster.instance_urls["decode"]), "pdserve:kv_transfer_bytes_total") > 0:
            break
        assert time.monotonic() < deadline, "the new D computed every prompt itself: no KV came from P"
        time.sleep(1)
    assert cluster.restarts == {**before, "decode": before["decode"] + 1}, "only the killed instance restarted"
