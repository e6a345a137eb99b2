"""Client: sends never block, cached sockets are bounded and can be forgotten, requests keep
their deadline and refuse oversized replies. Real sockets throughout."""

import socket
import threading
import time

import pytest
import zmq

from pdserve.control.codec import MAX_FRAME_BYTES, Codec
from pdserve.control.endpoint import Client, Server
from pdserve.control.messages import Ping, Release
from pdserve.errors import HandshakeError, TransferError

SECRET = b"client-secret"


@pytest.fixture
def client():
    client = Client(Codec(SECRET, "client"))
    yield client
    client.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_until(predicate, timeout_s=5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


class Inbox:
    def __init__(self):
        self.messages = []
        self.lock = threading.Lock()

    def __call__(self, envelope):
        with self.lock:
            self.messages.append(envelope.message)


def test_send_to_a_dead_peer_fails_at_once_when_the_queue_is_full(client):
    port = _free_port()
    slowest, error = 0.0, None
    for i in range(5000):
        start = time.monotonic()
        try:
            client.send("127.0.0.1", port, Release(f"tx-{i}"), recipient="gone")
        except TransferError as e:
            error = e
        slowest = max(slowest, time.monotonic() - start)
        if error is not None:
            break
    assert error is not None, "5000 messages queued to a dead peer without complaint"
    assert "already queued" in str(error)
    assert slowest < 0.2, f"send blocked its caller for {slowest:.3f} s"
    start = time.monotonic()
    with pytest.raises(TransferError):
        client.send("127.0.0.1", port, Release("tx-again"), recipient="gone")
    assert time.monotonic() - start < 0.2


def test_forget_drops_what_was_queued_for_the_old_incarnation(client):
    port = _free_port()
    for i in range(5):
        client.send("127.0.0.1", port, Release(f"old-{i}"), recipient="server")
    assert client.num_cached == 1
    assert client.forget("127.0.0.1", port) is True
    assert client.forget("127.0.0.1", port) is False
    assert client.num_cached == 0
    # the successor binds a moment later, as a restarted process does (seconds later): libzmq closes a
    # socket on its reaper thread, and a listener bound within that instant could still be reached
    time.sleep(0.5)
    inbox = Inbox()
    with Server("127.0.0.1", port, Codec(SECRET, "server"), inbox, name="successor") as server:
        client.send("127.0.0.1", port, Release("new"), recipient="server")
        assert _wait_until(lambda: server.num_handled >= 1)
        time.sleep(0.3)  # anything still queued for the old incarnation would arrive by now
        assert inbox.messages == [Release("new")]


def test_without_forget_queued_messages_do_reach_the_new_listener(client):
    """The counterpart of the test above: it is `forget`, not luck, that drops them."""
    port = _free_port()
    client.send("127.0.0.1", port, Release("old"), recipient="server")
    inbox = Inbox()
    with Server("127.0.0.1", port, Codec(SECRET, "server"), inbox, name="successor2") as server:
        client.send("127.0.0.1", port, Release("new"), recipient="server")
        assert _wait_until(lambda: server.num_handled == 2)
        assert inbox.messages == [Release("old"), Release("new")]


def test_idle_sockets_are_evicted_and_the_cache_is_bounded():
    with Client(Codec(SECRET, "client"), max_sockets=2, max_idle_s=3600) as client:
        ports = [_free_port() for _ in range(3)]
        for port in ports:
            client.send("127.0.0.1", port, Release("x"), recipient="peer")
        assert client.num_cached == 2, "the least recently used socket was closed"
        time.sleep(0.5)
        client.send("127.0.0.1", ports[2], Release("y"), recipient="peer")
        assert client.evict_idle(0.4) == 1, "only the socket unused for 0.5 s goes"
        assert client.num_cached == 1
        assert client.evict_idle(0) == 1 and client.num_cached == 0
    with Client(Codec(SECRET, "client"), max_idle_s=0.05) as client:
        client.send("127.0.0.1", _free_port(), Release("x"), recipient="peer")
        time.sleep(0.1)
        client.send("127.0.0.1", _free_port(), Release("x"), recipient="peer")
        assert client.num_cached == 1, "the idle socket was closed on the next send"


def test_request_refuses_an_oversized_reply_without_buffering_it(client):
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    stop = threading.Event()

    def answer_huge():
        while not stop.is_set():
            if router.poll(50, zmq.POLLIN):
                identity, _ = router.recv_multipart()
                router.send_multipart([identity, b"\0" * (2 * MAX_FRAME_BYTES)])

    thread = threading.Thread(target=answer_huge, daemon=True)
    thread.start()
    try:
        start = time.monotonic()
        with pytest.raises(HandshakeError, match="no reply .* within 1 s"):
            client.request("127.0.0.1", port, Ping(), timeout_s=1)
        assert time.monotonic() - start < 3
    finally:
        stop.set()
        thread.join(5)
        router.close(0)
        ctx.term()


def test_request_and_send_on_a_closed_client_raise_our_errors():
    client = Client(Codec(SECRET, "client"))
    client.close()
    with pytest.raises(HandshakeError, match="closed"):
        client.request("127.0.0.1", 1, Ping(), timeout_s=1)
    with pytest.raises(TransferError, match="closed"):
        client.send("127.0.0.1", 1, Ping())
