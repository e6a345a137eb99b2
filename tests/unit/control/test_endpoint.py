import socket
import threading
import time

import pytest
import zmq

from pdserve.control.codec import Codec
from pdserve.control.endpoint import Client, Server
from pdserve.control.messages import HandshakeRefused, HandshakeRequest, Ping, Pong, Release
from pdserve.errors import AddressInUseError, HandshakeError

SECRET = b"endpoint-secret"


class Recorder:
    def __init__(self):
        self.received = []
        self.event = threading.Event()

    def __call__(self, envelope):
        self.received.append(envelope)
        self.event.set()
        if isinstance(envelope.message, Ping):
            return Pong()
        if isinstance(envelope.message, HandshakeRequest):
            return HandshakeRefused(f"no thanks, {envelope.sender}")
        if isinstance(envelope.message, Release) and envelope.message.transfer_id == "boom":
            raise RuntimeError("handler bug")
        return None


@pytest.fixture
def server():
    recorder = Recorder()
    server = Server("127.0.0.1", 0, Codec(SECRET, "server"), recorder, name="test")
    server.recorder = recorder
    yield server
    server.close()


@pytest.fixture
def client():
    client = Client(Codec(SECRET, "client"))
    yield client
    client.close()


def _wait_until(predicate, timeout_s=5.0):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_request_reply(server, client):
    assert server.port > 0
    assert client.request("127.0.0.1", server.port, Ping(), timeout_s=5) == Pong()
    reply = client.request("127.0.0.1", server.port, HandshakeRequest("d", {}), timeout_s=5)
    assert reply == HandshakeRefused("no thanks, client")


def test_request_times_out_when_nobody_answers(client):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free_port = s.getsockname()[1]
    start = time.monotonic()
    with pytest.raises(HandshakeError, match=f"no reply from 127.0.0.1:{free_port} to Ping within 0.2 s"):
        client.request("127.0.0.1", free_port, Ping(), timeout_s=0.2)
    assert time.monotonic() - start < 2


def test_send_is_fire_and_forget(server, client):
    client.send("127.0.0.1", server.port, Release("tx-9"))
    assert server.recorder.event.wait(5)
    assert server.recorder.received[0].message == Release("tx-9")
    assert server.recorder.received[0].sender == "client"


def test_garbage_wrong_secret_and_handler_errors_do_not_stop_the_server(server, client):
    ctx = zmq.Context()
    raw = ctx.socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(f"tcp://127.0.0.1:{server.port}")
    try:
        raw.send(b"complete garbage")
        raw.send(Codec(b"wrong-secret", "mallory").encode(Ping()))
        raw.send_multipart([b"two", b"frames"])
        replayed = Codec(SECRET, "client").encode(Release("tx-replay"))
        raw.send(replayed)
        raw.send(replayed)
        assert _wait_until(lambda: server.num_rejected == 4), server.num_rejected
        client.send("127.0.0.1", server.port, Release("boom"))
        assert _wait_until(lambda: server.num_handler_errors == 1)
        assert client.request("127.0.0.1", server.port, Ping(), timeout_s=5) == Pong()
        assert [e.message for e in server.recorder.received][:1] == [Release("tx-replay")]
    finally:
        raw.close(0)
        ctx.term()


def test_reply_signed_with_another_secret_is_refused(server):
    with Client(Codec(b"other", "c")) as stranger:
        with pytest.raises(HandshakeError):
            stranger.request("127.0.0.1", server.port, Ping(), timeout_s=0.3)  # server drops it
    assert _wait_until(lambda: server.num_rejected == 1)


def test_port_in_use_is_a_clear_error(server):
    with pytest.raises(AddressInUseError, match=f"cannot bind 127.0.0.1:{server.port}: address already in use"):
        Server("127.0.0.1", server.port, Codec(SECRET, "s2"), lambda e: None, name="second")


def test_close_is_prompt_and_leaves_no_thread():
    server = Server("127.0.0.1", 0, Codec(SECRET, "s"), lambda e: None, name="closing")
    start = time.monotonic()
    server.close()
    server.close()
    assert time.monotonic() - start < 1
    assert not [t for t in threading.enumerate() if t.name == "pdserve-closing-server"]
    again = Server("127.0.0.1", server.port, Codec(SECRET, "s"), lambda e: None, name="rebound")
    again.close()


def test_ipv6_loopback(client):
    if not socket.has_ipv6:
        pytest.fail("this machine has no IPv6 support")
    try:
        server = Server("::1", 0, Codec(SECRET, "s6"), lambda e: Pong(), name="v6")
    except Exception as e:  # pragma: no cover - machine-specific
        pytest.fail(f"cannot bind ::1: {e}")
    try:
        assert client.request("::1", server.port, Ping(), timeout_s=5) == Pong()
    finally:
        server.close()
