"""PDWorker.take_stats: two real workers (KV in shared memory, control-plane servers on real
sockets); D's handshake with P is timed and reported once, in the payload PDConnectorStats reads."""

from __future__ import annotations

import socket

import pytest
import torch

from pdserve.config import parse_connector_config
from pdserve.connector.stats import PDConnectorStats
from pdserve.connector.worker.worker import PDWorker
from pdserve.control.address import PeerAddress
from tests.unit.connector.harness import secret_file

FINGERPRINT = {"model": "stats-test"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_worker(kv_role: str, secret_file: str) -> tuple[PDWorker, PeerAddress]:
    address = PeerAddress("127.0.0.1", free_port(), free_port())
    config = parse_connector_config(kv_role, {
        "handshake_port": address.handshake_port, "notify_port": address.notify_port, "handshake_timeout": 1.0,
    }, env={"PDSERVE_SECRET_FILE": secret_file})
    worker = PDWorker(config, FINGERPRINT)
    with torch.inference_mode():
        worker.register_kv_caches({f"layer.{i}": torch.zeros(4, 2, 16, 8, dtype=torch.bfloat16) for i in range(2)})
    return worker, address


@pytest.fixture
def workers(tmp_path):
    secret = secret_file(tmp_path, "stats-test-secret\n")
    started: list[PDWorker] = []
    try:
        p, p_address = start_worker("kv_producer", str(secret))
        started.append(p)
        d, _ = start_worker("kv_consumer", str(secret))
        started.append(d)
        yield p, p_address, d
    finally:
        for worker in started:
            worker.shutdown()


def test_an_answered_handshake_is_timed_and_reported_once(workers):
    p, p_address, d = workers
    assert d.take_stats() is None, "nothing happened yet"
    result = d._handshake.meet(p_address)
    assert not result.error and result.incarnation.identity == p.identity
    data = d.take_stats()
    assert data is not None and set(data) == set(PDConnectorStats().data), "a key vLLM's aggregation would drop"
    [seconds] = data["handshake_seconds"]
    assert 0 < seconds < 1.0
    assert (data["num_completed"], data["seconds"], data["transfer_bytes"]) == (0, [], [])
    assert d.take_stats() is None, "reported twice"


def test_an_unanswered_handshake_is_not_timed(workers):
    _, _, d = workers
    result = d._handshake.meet(PeerAddress("127.0.0.1", free_port(), free_port()))
    assert result.error
    assert d.take_stats() is None
