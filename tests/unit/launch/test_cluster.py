import threading
import time

import pytest
import requests

from pdserve.errors import LaunchError
from pdserve.launch.cluster import Cluster
from pdserve.launch.modes import Deployment, with_front
from pdserve.launch.ports import port_free
from pdserve.launch.process import group_members
from tests.unit.launch.fakes import FakeInstance

BASE = 18900


def launch(*instances) -> Cluster:
    cluster = Cluster(Deployment(tuple(instances)))
    cluster.start()
    return cluster


def leaders(cluster):
    return [p.pid for p in cluster.processes]


def test_start_healthy_stop_leaves_nothing():
    cluster = launch(FakeInstance("a", BASE), FakeInstance("b", BASE + 1))
    cluster.wait_healthy(30)
    assert cluster.endpoint == f"http://127.0.0.1:{BASE}"
    assert cluster.instance_urls == {"a": f"http://127.0.0.1:{BASE}", "b": f"http://127.0.0.1:{BASE + 1}"}
    assert requests.get(cluster.instance_urls["b"] + "/metrics", timeout=5).status_code == 200
    pgids = leaders(cluster)
    assert all(len(group_members(g)) == 2 for g in pgids)  # server + grandchild each
    run_dir = cluster.run_dir
    cluster.stop()
    assert all(group_members(g) == [] for g in pgids)
    assert port_free(BASE) and port_free(BASE + 1)
    assert not run_dir.exists()
    cluster.stop()  # idempotent


def test_instance_dying_during_start_fails_with_its_error_and_stops_the_others():
    cluster = launch(FakeInstance("ok", BASE + 2, delay=0.1), FakeInstance("bad", BASE + 3, delay=1.0, behaviour="die"))
    pgids = leaders(cluster)
    with pytest.raises(LaunchError, match=r"bad exited with code 3 during start: RuntimeError: boom while loading"):
        cluster.wait_healthy(30)
    assert all(group_members(g) == [] for g in pgids)
    assert not cluster.run_dir.exists()
    assert any("boom" in line for line in cluster.failure_log)


def test_deadline_and_sigkill_of_a_child_that_ignores_sigterm():
    cluster = launch(FakeInstance("slow", BASE + 4, behaviour="never-healthy"))
    with pytest.raises(LaunchError, match="slow not healthy after 2 s"):
        cluster.wait_healthy(2)
    cluster = launch(FakeInstance("stubborn", BASE + 5, behaviour="ignore-term"))
    cluster.wait_healthy(30)
    pgids = leaders(cluster)
    start = time.monotonic()
    cluster.stop(timeout=1.0)
    assert time.monotonic() - start < 5
    assert all(group_members(g) == [] for g in pgids)


def test_port_in_use_is_refused_before_anything_starts():
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", BASE + 6))
        sock.listen()
        cluster = Cluster(Deployment((FakeInstance("x", BASE + 6),)))
        with pytest.raises(LaunchError, match=f"port {BASE + 6} already in use"):
            cluster.start()
        assert cluster.processes == []


def test_stop_drains_the_front_while_the_instances_still_serve():
    cluster = Cluster(with_front(Deployment((FakeInstance("a", BASE + 7),)), drain_timeout=10))
    cluster.start()
    cluster.wait_healthy(30)
    assert cluster.endpoint == f"http://127.0.0.1:{BASE + 7}" and cluster.instance_urls == {"a": f"http://127.0.0.1:{BASE + 8}"}
    assert [p.name for p in cluster.processes] == ["a", "front"]  # the front started last
    outcome = {}
    slow = threading.Thread(target=lambda: outcome.update(slow=requests.get(f"{cluster.endpoint}/slow/2", timeout=30)))
    slow.start()
    time.sleep(0.5)  # the request is in flight
    stopper = threading.Thread(target=cluster.stop)
    start = time.monotonic()
    stopper.start()
    time.sleep(0.5)
    refused = requests.get(f"{cluster.endpoint}/health", timeout=10)
    assert refused.status_code == 503 and "shutting down" in refused.json()["error"]["message"]
    stopper.join(30)
    slow.join(30)
    assert outcome["slow"].status_code == 200 and outcome["slow"].text == "ok"
    assert 1.5 < time.monotonic() - start < 10
    assert all(group_members(p.pid) == [] for p in cluster.processes)
    assert port_free(BASE + 7) and port_free(BASE + 8)
