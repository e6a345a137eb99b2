import logging
import re
import socket
import threading
import time

import pytest
import zmq

from pdserve.control.codec import MAX_FRAME_BYTES, Codec
from pdserve.control.endpoint import Client, Server
from pdserve.control.messages import HandshakeRefused, HandshakeRequest, Ping, Pong, Release
from pdserve.errors import AddressInUseError, FencedError, HandshakeError

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
    envelope = client.exchange("127.0.0.1", server.port, HandshakeRequest("d", {}), timeout_s=5)
    assert (envelope.sender, envelope.message) == ("server", HandshakeRefused("no thanks, client"))


def test_request_times_out_when_nobody_answers(client):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free_port = s.getsockname()[1]
    start = time.monotonic()
    with pytest.raises(HandshakeError, match=f"no reply from 127.0.0.1:{free_port} to Ping within 0.2 s"):
        client.request("127.0.0.1", free_port, Ping(), timeout_s=0.2)
    assert time.monotonic() - start < 2


def test_send_is_fire_and_forget(server, client):
    client.send("127.0.0.1", server.port, Release("tx-9"), recipient="server")
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
        replayed = Codec(SECRET, "client").encode(Release("tx-replay"), "server")
        raw.send(replayed)
        raw.send(replayed)
        assert _wait_until(lambda: server.num_rejected == 4), server.num_rejected
        client.send("127.0.0.1", server.port, Release("boom"), recipient="server")
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


def _raw_dealer(port, routing_id=None):
    ctx = zmq.Context()
    raw = ctx.socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    if routing_id is not None:
        raw.setsockopt(zmq.ROUTING_ID, routing_id)
    raw.connect(f"tcp://127.0.0.1:{port}")
    return ctx, raw


def _close(ctx, *sockets):
    for s in sockets:
        s.close(0)
    ctx.term()


def test_replies_are_addressed_to_the_requester(server):
    ctx, raw = _raw_dealer(server.port)
    try:
        raw.send(Codec(SECRET, "client").encode(Ping()))
        assert raw.poll(5000, zmq.POLLIN)
        reply = raw.recv()
        with pytest.raises(FencedError, match="addressed to 'client'"):
            Codec(SECRET, "client-successor").decode(reply)
        envelope = Codec(SECRET, "client").decode(reply)
        assert envelope.message == Pong() and envelope.recipient == "client"
    finally:
        _close(ctx, raw)


def test_a_second_connection_with_a_known_routing_id_cannot_take_over_replies(server):
    codec = Codec(SECRET, "client")
    ctx, first = _raw_dealer(server.port, b"same-routing-id")
    second = ctx.socket(zmq.DEALER)
    second.setsockopt(zmq.LINGER, 0)
    second.setsockopt(zmq.ROUTING_ID, b"same-routing-id")
    try:
        first.send(codec.encode(Ping()))
        assert first.poll(5000, zmq.POLLIN), "the first connection is answered"
        first.recv()
        second.connect(f"tcp://127.0.0.1:{server.port}")
        second.send(codec.encode(Ping()))
        first.send(codec.encode(Ping()))
        assert first.poll(5000, zmq.POLLIN), "the first connection still gets its replies"
        first.recv()
        assert not second.poll(500, zmq.POLLIN), "the impostor got a reply meant for the first connection"
    finally:
        _close(ctx, first, second)


def test_an_oversized_frame_drops_the_connection_before_it_is_buffered(server):
    from zmq.utils.monitor import recv_monitor_message

    ctx, raw = _raw_dealer(server.port)
    monitor = raw.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    try:
        raw.send(Codec(SECRET, "client").encode(Ping()))
        assert raw.poll(5000, zmq.POLLIN)
        raw.recv()
        raw.send(b"\0" * (MAX_FRAME_BYTES + 1))
        assert monitor.poll(5000, zmq.POLLIN), "the server kept a connection that sent a frame above MAX_FRAME_BYTES"
        assert recv_monitor_message(monitor)["event"] == zmq.EVENT_DISCONNECTED
        assert server.num_rejected == 0, "the frame never reached the codec"
        with Client(Codec(SECRET, "client")) as client:
            assert client.request("127.0.0.1", server.port, Ping(), timeout_s=5) == Pong()
    finally:
        raw.disable_monitor()
        _close(ctx, monitor, raw)


def test_rejections_are_counted_exactly_and_logged_rate_limited(caplog):
    server = Server("127.0.0.1", 0, Codec(SECRET, "server"), lambda e: None, name="flooded",
                    warn_burst=3, warn_interval_s=0.3)
    ctx, raw = _raw_dealer(server.port)
    try:
        with caplog.at_level(logging.WARNING, logger="pdserve.control.endpoint"):
            for i in range(40):
                raw.send(b"garbage %d" % i + b"\0" * 40)
            assert _wait_until(lambda: server.num_rejected == 40), server.num_rejected
            summary = re.compile(r"flooded server rejected (\d+) more messages in the last")

            def logged():
                lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("flooded server")]
                full = [line for line in lines if not summary.match(line)]
                summed = sum(int(summary.match(line).group(1)) for line in lines if summary.match(line))
                return len(full), summed

            assert _wait_until(lambda: sum(logged()) == 40), logged()
            full, summed = logged()
            assert summed > 0 and full < 40, "a flood is summed up, not logged line by line"
            assert "AuthenticationError: " in next(r.getMessage() for r in caplog.records if summary.match(r.getMessage()))
    finally:
        _close(ctx, raw)
        server.close()
