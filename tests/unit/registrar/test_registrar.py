"""The registrar with real ZMQ sockets on loopback: a signed registration reaches the router's
socket unchanged; anything else is counted and never forwarded."""

from __future__ import annotations

import logging
import time
import types

import msgpack
import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

import pdserve.control.codec as codec_module
from pdserve.control.codec import Codec
from pdserve.control.messages import Ping
from pdserve.control.registration import Registration
from pdserve.registrar import Registrar

SECRET = b"s" * 32
GOOD = Registration("D", "127.0.0.1:8200", "host:127.0.0.1,handshake:6302,notify:6402", "READ")


class Setup:
    """A Registrar between a sender (DEALER) and a stand-in for vllm-router's discovery socket."""

    def __init__(self):
        self.context = zmq.Context()
        self.router = self.context.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        router_port = self.router.bind_to_random_port("tcp://127.0.0.1")
        monitor = self.router.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
        self.registrar = Registrar("127.0.0.1", 0, router_port, SECRET)
        # the registrar forwards only over a completed connection (an instance's next heartbeat comes
        # within a second); the tests start once its link to the router's socket is up
        try:
            assert monitor.poll(30_000), "the registrar never connected to the router's socket"
            recv_monitor_message(monitor)
        finally:
            self.router.disable_monitor()
            monitor.close(0)
        self.sender = self.context.socket(zmq.DEALER)
        self.sender.setsockopt(zmq.LINGER, 0)
        self.sender.connect(f"tcp://127.0.0.1:{self.registrar.port}")
        self.codec = Codec(SECRET, "decode-instance")

    def send(self, *frames: bytes) -> None:
        self.sender.send_multipart(list(frames))

    def forwarded(self, wait_s: float = 1.0) -> list[dict]:
        """What reached the router's socket within `wait_s` (each a decoded msgpack map)."""
        out, deadline = [], time.monotonic() + wait_s
        while time.monotonic() < deadline:
            if self.router.poll(50):
                identity, frame = self.router.recv_multipart()
                out.append(msgpack.unpackb(frame))
        return out

    def settle(self, handled: int, wait_s: float = 5.0) -> None:
        """Until the registrar has dealt with `handled` frames (forwarded, rejected or ignored)."""
        deadline = time.monotonic() + wait_s
        while self.num_handled() < handled and time.monotonic() < deadline:
            time.sleep(0.02)
        assert self.num_handled() == handled

    def num_handled(self) -> int:
        r = self.registrar
        return r.num_forwarded + r.num_rejected + r.num_ignored + r.num_undeliverable

    def close(self) -> None:
        self.registrar.close()
        self.sender.close(0)
        self.router.close(0)
        self.context.term()


@pytest.fixture
def setup():
    s = Setup()
    yield s
    s.close()


def test_a_signed_registration_reaches_the_router_unchanged(setup):
    setup.send(setup.codec.encode(GOOD))
    setup.settle(1, wait_s=30.0)  # a loaded machine may take seconds to schedule the registrar's thread
    assert setup.forwarded() == [{"type": "D", "http_address": "127.0.0.1:8200",
                                  "zmq_address": "host:127.0.0.1,handshake:6302,notify:6402",
                                  "transfer_mode": "READ", "tp_size": 1, "dp_size": 1}]
    assert (setup.registrar.num_forwarded, setup.registrar.num_rejected) == (1, 0)


def _stale(codec: Codec, msg, age_s: float, monkeypatch) -> bytes:
    with monkeypatch.context() as m:
        m.setattr(codec_module, "time", types.SimpleNamespace(time=lambda: time.time() - age_s))
        return codec.encode(msg)


@pytest.mark.parametrize("case, detail", [
    ("unsigned", "bad MAC"),
    ("wrong secret", "bad MAC"),
    ("tampered", "bad MAC"),
    ("stale", "stale message"),
    ("from the future", "from the future"),
    ("bad role", "type must be P or D"),
    ("bad address", "http_address must be host:port"),
    ("bad transfer mode", "transfer_mode must be READ or WRITE"),
    ("not msgpack", "bad MAC"),
    ("multipart", "expected [identity, frame]"),
    ("too short", "too short"),
])
def test_a_bad_registration_is_counted_logged_and_never_forwarded(setup, case, detail, monkeypatch, caplog):
    router_map = GOOD.router_map()
    frames = {
        "unsigned": lambda: [msgpack.packb(router_map)],  # what vllm-router itself would take
        "wrong secret": lambda: [Codec(b"not the secret", "intruder").encode(GOOD)],
        "tampered": lambda: [setup.codec.encode(GOOD).replace(b"127.0.0.1:8200", b"127.0.0.1:9999")],
        "stale": lambda: [_stale(setup.codec, GOOD, 120, monkeypatch)],
        "from the future": lambda: [_stale(setup.codec, GOOD, -120, monkeypatch)],
        "bad role": lambda: [setup.codec.encode(Registration(**{**router_map, "type": "X"}))],
        "bad address": lambda: [setup.codec.encode(Registration(**{**router_map, "http_address": "10.0.0.1"}))],
        "bad transfer mode": lambda: [setup.codec.encode(Registration(**{**router_map, "transfer_mode": "PUSH"}))],
        "not msgpack": lambda: [b"\xc1" * 64],
        "multipart": lambda: [setup.codec.encode(GOOD), b"more"],
        "too short": lambda: [b"x"],
    }[case]()
    with caplog.at_level(logging.WARNING, logger="pdserve.control.endpoint"):
        setup.send(*frames)
        setup.settle(1)
        assert setup.forwarded(0.3) == []
    assert (setup.registrar.num_rejected, setup.registrar.num_forwarded) == (1, 0)
    assert any("registrar server rejected" in r.message and detail in r.message for r in caplog.records), caplog.text


def test_a_replayed_registration_is_forwarded_once(setup):
    frame = setup.codec.encode(GOOD)
    setup.send(frame)
    setup.send(frame)
    setup.settle(2)
    assert len(setup.forwarded(0.3)) == 1
    assert (setup.registrar.num_forwarded, setup.registrar.num_rejected) == (1, 1)


def test_an_oversize_frame_is_dropped_and_the_registrar_serves_on(setup):
    setup.send(b"\x00" * (1 << 10))  # below MAX_REGISTRATION_FRAME_BYTES: read, fails the MAC check
    setup.settle(1)
    setup.send(b"\x00" * (4 << 10))  # above it: ZMQ drops the connection unread
    assert setup.forwarded(0.3) == []
    fresh = setup.context.socket(zmq.DEALER)  # the dropped connection's socket reconnects; a new one is quicker
    fresh.setsockopt(zmq.LINGER, 0)
    fresh.connect(f"tcp://127.0.0.1:{setup.registrar.port}")
    try:
        fresh.send(setup.codec.encode(GOOD))
        assert len(setup.forwarded(2.0)) == 1
        assert (setup.registrar.num_rejected, setup.registrar.num_forwarded) == (1, 1)
    finally:
        fresh.close(0)


def test_an_authentic_message_of_another_type_is_ignored(setup):
    setup.send(setup.codec.encode(Ping()))
    setup.settle(1)
    assert setup.forwarded(0.3) == [] and setup.registrar.num_ignored == 1


def test_a_flood_of_forgeries_is_logged_rate_limited(setup, caplog):
    with caplog.at_level(logging.WARNING, logger="pdserve.control.endpoint"):
        for _ in range(50):
            setup.send(msgpack.packb(GOOD.router_map()))
        setup.settle(50)
    assert setup.registrar.num_rejected == 50
    assert len([r for r in caplog.records if "registrar server rejected" in r.message]) <= 5


def test_registrations_wait_for_the_router_and_close_is_prompt():
    context = zmq.Context()
    port_holder = context.socket(zmq.ROUTER)
    router_port = port_holder.bind_to_random_port("tcp://127.0.0.1")
    port_holder.close(0)  # a port nothing listens on: the router has not started yet
    registrar = Registrar("127.0.0.1", 0, router_port, SECRET)
    sender = context.socket(zmq.DEALER)
    sender.setsockopt(zmq.LINGER, 0)
    sender.connect(f"tcp://127.0.0.1:{registrar.port}")
    try:
        sender.send(Codec(SECRET, "p").encode(GOOD))
        deadline = time.monotonic() + 5
        while registrar.num_undeliverable == 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert (registrar.num_undeliverable, registrar.num_forwarded) == (1, 0)
    finally:
        start = time.monotonic()
        registrar.close()
        registrar.close()
        assert time.monotonic() - start < 3
        sender.close(0)
        context.term()


def test_an_instance_registers_through_the_registrar_once_it_serves(tmp_path):
    """PDConnector's registration (connector/registration.py): signed with the secret file its
    config names, sent once its own /health answers."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    from threading import Thread

    from pdserve.config import parse_connector_config
    from pdserve.connector.registration import RouterRegistration

    class Health(BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:
            pass

        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

    secret = tmp_path / "secret"
    secret.write_bytes(SECRET)
    health = ThreadingHTTPServer(("127.0.0.1", 0), Health)
    Thread(target=health.serve_forever, daemon=True).start()
    s = Setup()
    config = parse_connector_config("kv_consumer", {
        "read_mode": True, "host_ip": "127.0.0.1", "http_port": health.server_port, "handshake_port": 6302,
        "notify_port": 6402, "proxy_ip": "127.0.0.1", "proxy_ping_port": s.registrar.port,
        "secret_file": str(secret), "heartbeat_interval": 0.1})
    registration = RouterRegistration(config)
    try:
        forwarded = s.forwarded(3.0)
        assert len(forwarded) >= 3 and s.registrar.num_rejected == 0
        assert forwarded[0] == {"type": "D", "http_address": f"127.0.0.1:{health.server_port}",
                                "zmq_address": "host:127.0.0.1,handshake:6302,notify:6402",
                                "transfer_mode": "READ", "tp_size": 1, "dp_size": 1}
    finally:
        registration.stop()
        health.shutdown()
        health.server_close()
        s.close()
