"""The front's limits on real sockets before a fake upstream: a slow head is cut off, a large or slow
body refused, a header value with CR, LF or NUL refused, idle connections neither starve a real
request nor exceed the connection limit. Nothing refused reaches the upstream."""

import resource
import socket
import threading
import time

import pytest
import requests
from multidict import CIMultiDict, CIMultiDictProxy

from pdserve.front.headers import forbidden_header
from tests.unit.front.fake_upstream import running
from tests.unit.front.test_front import openai_error

BASE = 27130  # 27130-27149


def connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=10)


def answer_of(sock: socket.socket) -> bytes:
    """Everything the front sends on `sock` until it closes it."""
    chunks = []
    try:
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    except ConnectionResetError:
        pass
    return b"".join(chunks)


def status_of(answer: bytes) -> int:
    return int(answer.split(b" ", 2)[1])


def wait_for(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


def test_a_head_sent_a_byte_at_a_time_is_cut_off_at_the_head_deadline():
    with running(BASE, head_timeout=1.5, connection_wait=0.5) as run:
        head = b"POST /echo HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 100
        with connect(BASE) as sock:
            start = time.monotonic()
            sent = 0
            try:
                for byte in head:
                    sock.sendall(bytes([byte]))
                    sent += 1
                    time.sleep(0.2)
            except (BrokenPipeError, ConnectionResetError):
                pass
            closed_after = time.monotonic() - start
            assert answer_of(sock) == b""
        assert sent < len(head) and 1.4 < closed_after < 3.0, (sent, closed_after)
        with connect(BASE) as idle:  # sends nothing at all: the same deadline
            start = time.monotonic()
            assert answer_of(idle) == b"" and 1.4 < time.monotonic() - start < 3.0
        assert run.upstream.requests == []
        assert requests.get(f"{run.url}/health", timeout=10).status_code == 200


def test_an_oversized_body_is_413_before_it_is_read():
    with running(BASE + 2, max_body_bytes=1000) as run:
        with connect(BASE + 2) as sock:  # declared too large: answered without sending the body
            sock.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 5000\r\n\r\n")
            answer = answer_of(sock)
        assert status_of(answer) == 413 and b"over the limit of 1000 bytes" in answer
        with connect(BASE + 2) as sock:  # chunked, found too large as it arrives
            sock.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
            for _ in range(3):
                sock.sendall(b"190\r\n" + b"x" * 400 + b"\r\n")
            answer = answer_of(sock)
        assert status_of(answer) == 413
        error = openai_error(requests.post(f"{run.url}/echo", data=b"x" * 1001, timeout=10), 413)
        assert "1000 bytes" in error["message"]
        assert requests.post(f"{run.url}/echo", data=b"x" * 1000, timeout=10).status_code == 200
        assert run.upstream.requests == ["POST /echo"]


def test_a_body_slower_than_its_deadline_is_408():
    with running(BASE + 4, body_timeout=1.0) as run:
        with connect(BASE + 4) as sock:
            start = time.monotonic()
            sock.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\nab")
            answer = answer_of(sock)
        assert status_of(answer) == 408 and b"did not arrive within 1 s" in answer
        assert 0.9 < time.monotonic() - start < 5
        assert run.upstream.requests == []


@pytest.mark.parametrize("header", [b"X-A: a\rX-Injected: 1", b"X-A: a\nX-Injected: 1", b"X-A: a\x00b",
                                    b"X-A: " + b"a" * 9000])
def test_a_header_with_cr_lf_or_nul_or_over_the_size_limit_is_400(header):
    with running(BASE + 6) as run:
        with connect(BASE + 6) as sock:
            sock.sendall(b"GET /echo HTTP/1.1\r\nHost: x\r\n" + header + b"\r\n\r\n")
            answer = answer_of(sock)
        assert status_of(answer) == 400 and b'"type": "BadRequestError"' in answer, answer
        assert run.upstream.requests == []


def test_a_target_that_is_not_a_path_is_400():
    with running(BASE + 12) as run:
        with connect(BASE + 12) as sock:
            sock.sendall(b"GET http://elsewhere.example/v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
            answer = answer_of(sock)
        assert status_of(answer) == 400 and b"the request target must be a path" in answer, answer
        assert run.upstream.requests == []


def test_header_values_are_checked_for_cr_lf_and_nul_whatever_the_parser():
    def check(value):
        return forbidden_header(CIMultiDictProxy(CIMultiDict([("Host", "x"), ("X-A", value)])))
    assert [check(v) for v in ("a\rb", "a\nb", "a\0b", "a b\t")] == ["X-A", "X-A", "X-A", None]


def _enough_files(count: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < count:
        assert hard >= count, f"this test needs {count} open files, the hard limit is {hard}"
        resource.setrlimit(resource.RLIMIT_NOFILE, (count, hard))


def test_a_thousand_idle_connections_do_not_stop_a_real_request():
    _enough_files(2 * 1000 + 200)
    with running(BASE + 8, head_timeout=30) as run:
        idle = []
        try:
            for _ in range(1000):
                idle.append(connect(BASE + 8))
            wait_for(lambda: run.front.num_connections == 1000)
            start = time.monotonic()
            status = requests.post(f"{run.url}/echo", json={"real": True}, timeout=10).status_code
            assert status == 200 and time.monotonic() - start < 2
            assert run.front.num_connections <= run.front.config.limits.max_connections
        finally:
            for sock in idle:
                sock.close()
        wait_for(lambda: run.front.num_connections == 0)


def test_the_connection_limit_holds_and_a_waiting_connection_gets_a_freed_slot():
    with running(BASE + 10, max_connections=20, connection_wait=0.5, head_timeout=30) as run:
        idle = [connect(BASE + 10) for _ in range(20)]
        try:
            wait_for(lambda: run.front.num_connections == 20)
            start = time.monotonic()
            error = openai_error(requests.get(f"{run.url}/health", timeout=10), 503)
            assert "limit of 20 connections" in error["message"] and 0.45 < time.monotonic() - start < 3
            waiting = [connect(BASE + 10) for _ in range(20)]  # as many as may wait: one more is refused at once
            wait_for(lambda: run.front.num_waiting == 20)
            start = time.monotonic()
            assert openai_error(requests.get(f"{run.url}/health", timeout=10), 503)
            assert time.monotonic() - start < 0.4 and run.front.num_connections == 20
            assert [status_of(answer_of(sock)) for sock in waiting] == [503] * 20  # their wait ran out
            for sock in waiting:
                sock.close()
            outcome = {}
            thread = threading.Thread(target=lambda: outcome.update(r=requests.get(f"{run.url}/health", timeout=10)))
            thread.start()
            wait_for(lambda: run.front.num_waiting == 1)
            idle.pop().close()  # a slot frees while it waits: it is served
            thread.join(10)
            assert outcome["r"].status_code == 200 and run.front.num_connections <= 20
        finally:
            for sock in idle:
                sock.close()
        assert run.upstream.requests == ["GET /health"]


def test_slow_bodies_near_the_connection_limit_get_the_busy_deadline():
    with running(BASE + 14, max_connections=16, connection_wait=0.5, head_timeout=30, body_timeout=30,
                 busy_body_timeout=1.0) as run:
        slow = []
        try:
            for _ in range(16):  # every slot: the 14th brings the pressure (7/8 held)
                sock = connect(BASE + 14)
                sock.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\nab")
                slow.append(sock)
            start = time.monotonic()
            answers = [answer_of(sock) for sock in slow]
            assert time.monotonic() - start < 5  # not the 30 s body deadline
            assert all(status_of(a) == 408 and b"did not arrive within 1 s" in a for a in answers), answers[:1]
        finally:
            for sock in slow:
                sock.close()
        assert requests.post(f"{run.url}/echo", data=b"x", timeout=10).status_code == 200
        assert run.upstream.requests == ["POST /echo"]


def test_bodies_held_at_once_are_bounded_and_one_more_is_503_before_it_is_read():
    with running(BASE + 16, max_body_bytes=1000, max_body_bytes_in_flight=2000, head_timeout=30) as run:
        held = [connect(BASE + 16) for _ in range(2)]
        try:
            for sock in held:  # 2 x 1000 bytes declared, 999 sent: the whole budget
                sock.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n" + b"x" * 999)
            wait_for(lambda: run.front.num_body_bytes_held == 2000)
            with connect(BASE + 16) as sock:
                sock.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\n")
                answer = answer_of(sock)
            assert status_of(answer) == 503 and b"2000 bytes of request bodies" in answer, answer
            for sock in held:
                sock.sendall(b"x")
                assert status_of(sock.recv(65536)) == 200
        finally:
            for sock in held:
                sock.close()
        wait_for(lambda: run.front.num_body_bytes_held == 0)
