import threading
import time

import pytest
import zmq

from pdserve.control.codec import Codec
from pdserve.control.registration import Registration, RegistrationHeartbeat
from pdserve.errors import AuthenticationError, ProtocolError

SECRET = b"k" * 32
REGISTRATION = Registration("P", "127.0.0.1:8100", "host:127.0.0.1,handshake:6301,notify:6401", "WRITE")
PAYLOAD = {"type": "P", "http_address": "127.0.0.1:8100", "zmq_address": "host:127.0.0.1,handshake:6301,notify:6401",
           "transfer_mode": "WRITE", "tp_size": 1, "dp_size": 1}


def beat(port: int, interval_s: float, when=None) -> RegistrationHeartbeat:
    return RegistrationHeartbeat("127.0.0.1", port, REGISTRATION, Codec(SECRET, "instance"), interval_s, when)


def test_heartbeat_delivers_fresh_signed_frames_and_stops_cleanly():
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    heartbeat = beat(port, 0.05)
    registrar = Codec(SECRET, "registrar")
    try:
        frames = []
        deadline = time.monotonic() + 5
        while len(frames) < 3 and time.monotonic() < deadline:
            if router.poll(100):
                identity, frame = router.recv_multipart()
                frames.append(frame)
        envelopes = [registrar.decode(f) for f in frames]  # each its own nonce: none is refused as a replay
        assert [e.message for e in envelopes] == [REGISTRATION] * 3 and envelopes[0].sender == "instance"
        assert envelopes[0].message.router_map() == PAYLOAD
        with pytest.raises(AuthenticationError, match="bad MAC"):
            Codec(b"another secret", "registrar").decode(frames[0])
        start = time.monotonic()
        heartbeat.stop()
        heartbeat.stop()
        assert time.monotonic() - start < 1
        assert not [t for t in threading.enumerate() if t.name == "pdserve-registration"]
        sent = heartbeat.num_sent
        while router.poll(200):
            router.recv_multipart()
        assert not router.poll(200), "no beat after stop()"
        assert heartbeat.num_sent == sent
    finally:
        heartbeat.stop()
        router.close(0)
        ctx.term()


def test_stop_is_prompt_even_when_the_router_is_down():
    heartbeat = beat(1, 10)
    time.sleep(0.05)
    start = time.monotonic()
    heartbeat.stop()
    assert time.monotonic() - start < 1


def test_a_heartbeat_with_when_beats_only_while_it_is_true():
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    beating = threading.Event()

    def when() -> bool:
        if not beating.is_set():
            return False
        raise RuntimeError("a failing predicate skips the beat")  # noqa: EM101

    answers = iter([False, False, True, True, True])
    heartbeat = beat(port, 0.05, when=lambda: next(answers, False))
    try:
        received = 0
        deadline = time.monotonic() + 2
        while time.monotonic() < deadline:
            if router.poll(50):
                router.recv_multipart()
                received += 1
        assert received == heartbeat.num_sent == 3
    finally:
        heartbeat.stop()
    failing = beat(port, 0.05, when=when)
    try:
        beating.set()
        time.sleep(0.3)
        assert failing.num_sent == 0 and failing._thread.is_alive()
    finally:
        failing.stop()
        router.close(0)
        ctx.term()


@pytest.mark.parametrize("field, value, problem", [
    ("type", "X", "type must be P or D"),
    ("transfer_mode", "PUSH", "transfer_mode must be READ or WRITE"),
    ("http_address", "127.0.0.1", "http_address must be host:port"),
    ("http_address", "127.0.0.1:0", "http_address must be host:port"),
    ("http_address", "bad host:80", "bad host"),
    ("zmq_address", "host:127.0.0.1,handshake:1", "missing notify"),
    ("tp_size", 0, "tp_size and dp_size"),
])
def test_a_registration_with_a_bad_field_is_refused(field, value, problem):
    bad = Registration(**{**PAYLOAD, field: value})
    with pytest.raises(ProtocolError, match=problem):
        bad.validate()
    with pytest.raises(ProtocolError, match=problem):
        RegistrationHeartbeat("127.0.0.1", 1, bad, Codec(SECRET, "instance"))  # refused before any thread starts


def test_a_registration_names_ipv6_and_dns_hosts():
    for address in ("[::1]:8100", "prefill-0.pd.svc:8100"):
        Registration(**{**PAYLOAD, "http_address": address}).validate()
