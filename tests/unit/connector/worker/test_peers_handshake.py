"""PeerTable's handshakes never wait for one another. Real sockets on loopback: D is a real
PDWorker whose handshake the table runs; P is a real PDWorker; the peers that never answer are a
ZMQ ROUTER that never reads and TCP listeners that never accept; the dead ones are ports nobody
listens on. Only the transport the table attaches peers to is a recording fake."""

from __future__ import annotations

import queue
import socket
import threading
import time

import pytest
import torch
import zmq

from pdserve.config import parse_connector_config
from pdserve.connector.worker.worker import PDWorker
from pdserve.control.address import PeerAddress
from pdserve.transfer import peers as peer_table
from pdserve.transfer.allowlist import PeerAllowList
from pdserve.transfer.peers import HandshakeResult, PeerState, PeerTable
from tests.unit.connector.harness import secret_file

HANDSHAKE_TIMEOUT_S = 2.0
QUICK_S = 0.5  # well under one handshake timeout
NUM_SILENT = 64


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RecordingTransport:
    def __init__(self):
        self.attached: list[str] = []

    def attach_peer(self, identity, regions, route=None) -> None:
        self.attached.append(identity)

    def detach_peer(self, identity) -> None:
        self.attached.remove(identity)


class Instances:
    """Real workers sharing one secret; `start` one at an address (a fresh one if None)."""

    def __init__(self, secret_file: str):
        self.secret_file = secret_file
        self.started: list[PDWorker] = []

    def start(self, kv_role: str, address: PeerAddress | None = None) -> tuple[PDWorker, PeerAddress]:
        address = address or PeerAddress("127.0.0.1", free_port(), free_port())
        config = parse_connector_config(kv_role, {
            "handshake_port": address.handshake_port, "notify_port": address.notify_port,
            "handshake_timeout": HANDSHAKE_TIMEOUT_S,
        }, env={"PDSERVE_SECRET_FILE": self.secret_file})
        worker = PDWorker(config, {"model": "handshake-test"})
        with torch.inference_mode():
            worker.register_kv_caches({f"layer.{i}": torch.zeros(4, 2, 16, 8, dtype=torch.bfloat16) for i in range(2)})
        self.started.append(worker)
        return worker, address


class Silent:
    """Addresses that accept connections and never answer: `num_router` ports of one ZMQ ROUTER
    that never reads, and `num_listeners` TCP listeners that never accept."""

    def __init__(self, num_router: int, num_listeners: int):
        self.context = zmq.Context()
        self.router = self.context.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        ports = [self.router.bind_to_random_port("tcp://127.0.0.1") for _ in range(num_router)]
        self.listeners = []
        for _ in range(num_listeners):
            listener = socket.socket()
            listener.bind(("127.0.0.1", 0))
            listener.listen(8)
            self.listeners.append(listener)
            ports.append(listener.getsockname()[1])
        self.addresses = [PeerAddress("127.0.0.1", port, free_port()) for port in ports]

    def close(self) -> None:
        self.router.close(0)
        self.context.term()
        for listener in self.listeners:
            listener.close()


class Table:
    """A PeerTable driven the way the engine drives it: results come back through a queue and
    are applied on this (the "worker") thread."""

    def __init__(self, d: PDWorker):
        self.results: queue.SimpleQueue[HandshakeResult] = queue.SimpleQueue()
        self.transport = RecordingTransport()
        self.peers = PeerTable(self.transport, d._handshake.meet, self.results.put, PeerAllowList(("127.0.0.0/8",)), 300.0)

    def apply_until(self, condition, timeout_s: float) -> float:
        """Apply results until `condition()`; returns the seconds it took, fails at the deadline."""
        start = time.monotonic()
        while not condition():
            left = timeout_s - (time.monotonic() - start)
            assert left > 0, f"not met within {timeout_s} s"
            try:
                self.peers.apply(self.results.get(timeout=min(left, 0.05)))
            except queue.Empty:
                pass
        return time.monotonic() - start


@pytest.fixture
def instances(tmp_path):
    secret = secret_file(tmp_path, "handshake-test-secret\n")
    instances = Instances(str(secret))
    yield instances
    for worker in instances.started:
        worker.shutdown()


@pytest.fixture
def silent():
    silent = Silent(num_router=NUM_SILENT // 2, num_listeners=NUM_SILENT // 2)
    yield silent
    silent.close()


def handshake_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("pdserve-handshake")]


def test_a_live_peer_is_met_at_once_behind_dead_and_silent_ones(instances, silent):
    d, _ = instances.start("kv_consumer")
    p, p_address = instances.start("kv_producer")
    table = Table(d)
    dead = [PeerAddress("127.0.0.1", free_port(), free_port()) for _ in range(16)]
    strangers = silent.addresses[:16] + dead
    for address in strangers:
        assert table.peers.lookup(address).state is PeerState.CONNECTING
    live = table.peers.lookup(p_address)
    took = table.apply_until(lambda: live.state is PeerState.READY, timeout_s=8 * HANDSHAKE_TIMEOUT_S)
    assert took < QUICK_S, f"the live peer waited {took:.2f} s behind {len(strangers)} that never answer"
    assert live.key == p.identity and table.transport.attached == [p.identity]

    table.apply_until(lambda: all(table.peers.lookup(a).state is PeerState.FAILED for a in dead), timeout_s=QUICK_S)
    for address in dead:
        error = table.peers.lookup(address).error
        assert f"127.0.0.1:{address.handshake_port}" in error and "connection refused" in error
    silent_ones = silent.addresses[:16]
    table.apply_until(lambda: all(table.peers.lookup(a).state is PeerState.FAILED for a in silent_ones),
                      timeout_s=2 * HANDSHAKE_TIMEOUT_S)
    for address in silent_ones:
        error = table.peers.lookup(address).error
        assert f"no reply from 127.0.0.1:{address.handshake_port}" in error and "refused" not in error
    assert table.peers.num_handshakes == 0
    table.peers.close()
    assert handshake_threads() == []


def test_strangers_past_the_bound_fail_at_once_and_a_restarted_peer_is_still_met(instances, silent):
    d, _ = instances.start("kv_consumer")
    p, p_address = instances.start("kv_producer")
    table = Table(d)
    first = table.peers.lookup(p_address)
    table.apply_until(lambda: first.state is PeerState.READY, timeout_s=QUICK_S)

    bound = peer_table.MAX_STRANGER_HANDSHAKES
    assert bound <= len(silent.addresses)
    for address in silent.addresses[:bound]:  # fill every stranger's place with a peer that never answers
        assert table.peers.lookup(address).state is PeerState.CONNECTING
    for address in [PeerAddress("127.0.0.1", free_port(), free_port())] + silent.addresses[bound:]:
        refused = table.peers.lookup(address)
        assert refused.state is PeerState.FAILED, "a stranger past the bound must fail now, not queue"
        assert f"127.0.0.1:{address.handshake_port}" in refused.error and "in flight" in refused.error
    assert table.peers.num_handshakes == bound

    # P restarts at its address: down, it fails at once; up again, it is met despite the strangers.
    p.shutdown()
    table.peers.drop(p_address)
    down = table.peers.lookup(p_address)
    table.apply_until(lambda: down.state is not PeerState.CONNECTING, timeout_s=QUICK_S)
    assert down.state is PeerState.FAILED and "connection refused" in down.error
    successor, _ = instances.start("kv_producer", p_address)
    time.sleep(peer_table.RETRY_AFTER_S)
    again = table.peers.lookup(p_address)
    took = table.apply_until(lambda: again.state is PeerState.READY, timeout_s=QUICK_S)
    assert again.key == successor.identity != p.identity, f"met after {took:.2f} s"
    assert table.peers.num_handshakes == bound, "the strangers still wait; the restarted peer did not"

    d.shutdown()  # closing the control client ends the handshakes still waiting for an answer
    instances.started.remove(d)
    start = time.monotonic()
    table.peers.close()
    assert time.monotonic() - start < QUICK_S
    assert handshake_threads() == [], "a handshake thread outlived close()"
