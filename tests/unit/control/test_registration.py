import threading
import time

import msgpack
import zmq

from pdserve.control.registration import RegistrationHeartbeat

PAYLOAD = {
    "type": "P",
    "http_address": "127.0.0.1:8100",
    "zmq_address": "host:127.0.0.1,handshake:6301,notify:6401",
    "transfer_mode": "WRITE",
}


def test_heartbeat_delivers_payloads_to_a_router_socket_and_stops_cleanly():
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    heartbeat = RegistrationHeartbeat("127.0.0.1", port, PAYLOAD, interval_s=0.05)
    try:
        received = []
        deadline = time.monotonic() + 5
        while len(received) < 3 and time.monotonic() < deadline:
            if router.poll(100):
                identity, frame = router.recv_multipart()
                received.append(msgpack.unpackb(frame))
        assert received == [PAYLOAD] * 3
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
    heartbeat = RegistrationHeartbeat("127.0.0.1", 1, PAYLOAD, interval_s=10)
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
    heartbeat = RegistrationHeartbeat("127.0.0.1", port, PAYLOAD, interval_s=0.05,
                                      when=lambda: next(answers, False))
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
    failing = RegistrationHeartbeat("127.0.0.1", port, PAYLOAD, interval_s=0.05, when=when)
    try:
        beating.set()
        time.sleep(0.3)
        assert failing.num_sent == 0 and failing._thread.is_alive()
    finally:
        failing.stop()
        router.close(0)
        ctx.term()
