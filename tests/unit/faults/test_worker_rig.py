"""A real PDWorker routes its transport, the messages it sends and its named points through the
rig that pdserve/rigs.py attaches, and with the fault rig a plan's rules act on real sockets."""

from __future__ import annotations

import json
import socket
import time

import pytest
import torch

from pdserve.config import parse_connector_config
from pdserve.connector.worker.worker import PDWorker
from pdserve.control.address import PeerAddress
from pdserve.control.messages import WriteDone
from pdserve.faults.rig import RIG_NAME, register
from pdserve.rigs import Rig, register_rig, unregister_rig
from pdserve.transport.shm import ShmTransport
from tests.unit.connector.harness import secret_file

WAIT_S = 5.0


class Recorder(Rig):
    def __init__(self):
        self.wrapped: list = []
        self.sent: list[str] = []
        self.points: list[str] = []

    def wrap_transport(self, transport):
        self.wrapped.append(transport)
        return transport

    def outgoing(self, message, send):
        self.sent.append(type(message).__name__)
        return send(message)

    def at(self, point: str) -> None:
        self.points.append(point)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def start(tmp_path):
    secret = secret_file(tmp_path, "rig-test-secret\n")
    started: list[PDWorker] = []

    def start_worker(kv_role: str, **extra) -> tuple[PDWorker, PeerAddress]:
        address = PeerAddress("127.0.0.1", free_port(), free_port())
        config = parse_connector_config(kv_role, {
            "handshake_port": address.handshake_port, "notify_port": address.notify_port, **extra,
        }, env={"PDSERVE_SECRET_FILE": str(secret)})
        worker = PDWorker(config, {"model": "rig-test"})
        started.append(worker)
        with torch.inference_mode():
            worker.register_kv_caches({f"layer.{i}": torch.zeros(4, 2, 16, 8, dtype=torch.bfloat16) for i in range(2)})
        return worker, address

    yield start_worker
    for worker in started:
        worker.shutdown()


@pytest.fixture
def recorders():
    """A recording rig for every D worker started while the fixture is active."""
    made: list[Recorder] = []

    def factory(config):
        if config.role.value != "D":
            return None
        made.append(Recorder())
        return made[-1]

    register_rig("recorder", factory)
    register()
    yield made
    unregister_rig("recorder")
    unregister_rig(RIG_NAME)


def wait_for(condition) -> bool:
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.01)
    return False


def test_the_worker_goes_through_its_rig(start, recorders):
    d, d_address = start("kv_consumer")
    p, p_address = start("kv_producer")
    [rig] = recorders
    assert len(rig.wrapped) == 1 and type(rig.wrapped[0]) is ShmTransport
    assert p.notify(d_address, WriteDone("t-1", False), d.identity)
    assert wait_for(lambda: "receive:write_done" in rig.points), rig.points
    assert d.notify(p_address, WriteDone("t-2", False), p.identity)
    assert rig.sent == ["WriteDone"]


def test_a_fault_plan_drops_what_the_worker_sends(start, recorders, tmp_path):
    plan = tmp_path / "faults.json"
    plan.write_text(json.dumps({"rules": [{"action": "drop", "message": "write_done", "count": 1}]}))
    d, d_address = start("kv_consumer")
    p, _ = start("kv_producer", test_fault_plan=str(plan))
    [rig] = recorders
    assert p.notify(d_address, WriteDone("dropped", False), d.identity)
    assert p.notify(d_address, WriteDone("sent", False), d.identity)
    assert wait_for(lambda: "receive:write_done" in rig.points)
    time.sleep(0.2)
    assert rig.points == ["receive:write_done"], "the first WriteDone was not dropped"
