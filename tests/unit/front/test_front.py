"""The front on real sockets before a fake upstream: pass-through on kept-alive connections, /v1/models,\nerror shapes, drain."""

import asyncio
import json
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
import requests

from pdserve.front.server import DRAINING_MESSAGE, State
from pdserve.launch.ports import port_free
from tests.unit.front.fake_upstream import MODELS, VLLM_404, running

BASE = 27100  # 27100-27131


def openai_error(response: requests.Response, status: int) -> dict:
    """The response's OpenAI error object, checked to be one."""
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == status, error
    return error


def raw(port: int, data: bytes) -> bytes:
    """Send `data` on a fresh connection; everything the front answers until it closes."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(data)
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


def test_requests_and_bodies_pass_through_on_kept_alive_connections():
    with running(BASE) as run:
        body = {"model": "m", "prompt": "héllo"}
        with requests.Session() as session:  # one client connection, kept alive
            for _ in range(3):
                response = session.post(f"{run.url}/echo?x=1", json=body, timeout=10, headers={
                    "X-Request-Id": "r1", "Connection": "keep-alive, X-Hop", "X-Hop": "1", "Keep-Alive": "timeout=9",
                    "TE": "trailers"})
                assert "close" not in response.headers.get("connection", "").lower()
        echoed = response.json()
        assert json.loads(echoed["body"].encode("latin-1")) == body and echoed["target"] == "/echo?x=1"
        headers = {k.lower(): v for k, v in echoed["headers"]}
        assert headers["content-length"] == str(len(echoed["body"]))
        assert not {"connection", "keep-alive", "x-hop", "te", "transfer-encoding"} & set(headers)  # hop-by-hop
        assert "x-request-id" not in headers  # pdserve's own, never a client's
        chunked = raw(BASE, b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n"
                            b"\r\n5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n")
        assert chunked.startswith(b"HTTP/1.1 200")
        echoed = json.loads(chunked.split(b"\r\n\r\n", 1)[1])
        headers = {k.lower(): v for k, v in echoed["headers"]}
        assert echoed["body"] == "hello world" and headers["content-length"] == "11"  # decoded, sent with a length
        assert "transfer-encoding" not in headers
        continued = raw(BASE, b"POST /echo HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nConnection: close\r\n"
                              b"Content-Length: 2\r\n\r\nok")
        assert continued.startswith(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200") and b'"body": "ok"' in continued


def test_the_upstream_connection_is_kept_alive_and_reused():
    with running(BASE + 24) as run:
        for _ in range(20):  # sequential requests, each on a new client connection
            assert requests.post(f"{run.url}/echo", json={"i": 1}, timeout=10).status_code == 200
        with requests.get(f"{run.url}/stream?n=3", stream=True, timeout=10) as response:
            assert len([line for line in response.iter_lines() if line]) == 3
        assert len(run.upstream.requests) == 21
        assert len(run.upstream.peers) == 1, run.upstream.peers  # one upstream connection carried all of them


def test_a_stream_is_relayed_as_it_arrives():
    with running(BASE + 2) as run:
        arrivals = []
        with requests.get(f"{run.url}/stream?n=5&gap=0.3", stream=True, timeout=10) as response:
            assert response.status_code == 200 and response.headers["content-type"] == "text/event-stream"
            for line in response.iter_lines():
                if line:
                    arrivals.append((time.monotonic(), json.loads(line[6:])["i"]))
        assert [i for _, i in arrivals] == [0, 1, 2, 3, 4]
        assert arrivals[-1][0] - arrivals[0][0] > 0.9  # not buffered until the end


def test_a_client_leaving_mid_stream_ends_the_upstream_request():
    with running(BASE + 26) as run:
        with requests.get(f"{run.url}/stream?n=100&gap=0.1", stream=True, timeout=10) as response:
            lines = response.iter_lines()
            assert [next(lines) for _ in range(2)] == [b'data: {"i": 0}', b""]
        deadline = time.monotonic() + 5
        while run.upstream.num_streams_cancelled == 0:  # vLLM aborts a request whose connection closes
            assert time.monotonic() < deadline, "the upstream request outlived its client"
            time.sleep(0.01)
        assert run.front.num_in_flight == 0


def test_an_upstream_silent_past_the_idle_timeout_breaks_the_stream_visibly():
    with running(BASE + 28, idle_timeout=0.5) as run:
        with requests.get(f"{run.url}/stream?n=3&gap=2", stream=True, timeout=10) as response:
            assert response.status_code == 200
            with pytest.raises(requests.exceptions.ChunkedEncodingError):  # not a clean end of the stream
                list(response.iter_lines())


def test_a_client_that_stops_reading_is_cut_off_after_the_idle_timeout():
    with running(BASE + 30, idle_timeout=1.0) as run:
        with socket.create_connection(("127.0.0.1", BASE + 30), timeout=10) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.sendall(b"GET /stream?n=400&gap=0&pad=65536 HTTP/1.1\r\nHost: x\r\n\r\n")  # 26 MB, never read
            deadline = time.monotonic() + 10
            while run.front.num_in_flight == 0:
                assert time.monotonic() < deadline
                time.sleep(0.01)
            while run.upstream.num_streams_cancelled == 0:
                assert time.monotonic() < deadline, "a client that reads nothing held its request"
                time.sleep(0.05)
            assert run.front.num_in_flight == 0


def test_models_are_asked_of_the_instances_in_turn():
    with running(BASE + 4, models_from=(BASE + 19, BASE + 5)) as run:  # the first one is down
        assert requests.get(f"{run.url}/v1/models", timeout=10).json() == MODELS
    with running(BASE + 6, models_from=(BASE + 19,)) as run:
        error = openai_error(requests.get(f"{run.url}/v1/models", timeout=10), 503)
        assert error["message"].startswith("no instance answered GET /v1/models (instance27119: the instance27119 "
                                           "is unreachable")
        assert "127.0.0.1" not in error["message"]  # its address is logged, not told


@pytest.mark.parametrize("path, status, message", [
    ("/router-422", 400, "Failed to deserialize the JSON body into the target type: missing field `model`"),
    ("/router-400", 400, "Failed to parse the request body as JSON: expected value at line 1 column 1"),
    ("/wrapped-404", 404, VLLM_404["error"]["message"]),
    ("/vllm-404", 404, VLLM_404["error"]["message"]),
    ("/no-workers", 503, "No workers available via service discovery: 0 prefill, 0 decode"),
    ("/chunked-503", 503, "No prefill servers available"),
    ("/empty-404", 404, "GET /empty-404: Not Found"),
])
def test_errors_reach_the_client_in_openai_shape(path, status, message):
    with running(BASE + 8) as run:
        error = openai_error(requests.get(f"{run.url}{path}", timeout=10), status)
        assert error["message"].startswith(message), error
        assert error["type"] == {400: "BadRequestError", 404: "NotFoundError", 503: "ServiceUnavailableError"}[status]
        if path == "/vllm-404":
            assert requests.get(f"{run.url}{path}", timeout=10).json() == VLLM_404  # vLLM's own: unchanged


def test_an_unreachable_upstream_and_a_malformed_request_are_named():
    with running(BASE + 10, upstream_port=BASE + 19) as run:
        error = openai_error(requests.get(f"{run.url}/v1/completions", timeout=10), 502)
        assert error["message"].startswith("the router is unreachable (Connection refused)")
        answer = raw(BASE + 10, b"GET /x HTTP/1.1\r\nbad header line\r\n\r\n")
        assert answer.split(b" ", 2)[1] == b"400" and b"malformed request: Invalid header token" in answer
        answer = raw(BASE + 10, b"POST /x HTTP/1.1\r\nContent-Length: 2\r\nTransfer-Encoding: chunked\r\n\r\n")
        assert answer.split(b" ", 2)[1] == b"400" and b"Transfer-Encoding can't be present with Content-Length" in answer


def test_drain_finishes_requests_in_flight_and_refuses_new_ones():
    with running(BASE + 12, drain_timeout=10) as run:
        results = {}
        slow = threading.Thread(target=lambda: results.update(slow=requests.get(f"{run.url}/slow?s=1.5", timeout=10)))
        slow.start()
        deadline = time.monotonic() + 5
        while run.front.num_in_flight == 0:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        start = time.monotonic()
        drained = run.drain_soon()
        while run.front.state is not State.DRAINING:
            time.sleep(0.01)
        refused = requests.get(f"{run.url}/health", timeout=10)
        assert openai_error(refused, 503)["message"] == DRAINING_MESSAGE
        assert drained.result(10) == 0  # nothing cut off
        slow.join(10)
        assert results["slow"].status_code == 200 and results["slow"].json() == {"slept": True}
        assert 1.0 < time.monotonic() - start < 5
        assert run.front.state is State.STOPPED and port_free(BASE + 12)


def test_drain_cuts_off_what_outlives_its_deadline():
    with running(BASE + 14, drain_timeout=0.5) as run:
        outcome = {}

        def stuck():
            try:
                outcome["response"] = requests.get(f"{run.url}/slow?s=30", timeout=10)
            except requests.RequestException as exc:
                outcome["error"] = exc

        thread = threading.Thread(target=stuck)
        thread.start()
        while run.front.num_in_flight == 0:
            time.sleep(0.01)
        start = time.monotonic()
        assert run.drain_soon().result(10) == 1
        assert time.monotonic() - start < 2
        thread.join(10)
        assert "error" in outcome  # the connection was closed on it: it cannot mistake it for an answer


def test_the_front_process_drains_on_sigterm_and_exits():
    with running(BASE + 16) as run:  # its fake upstream, on BASE + 17, serves the process below
        port = BASE + 18
        front = subprocess.Popen([sys.executable, "-m", "pdserve.front", "--port", str(port),
                                  "--upstream", f"router=http://127.0.0.1:{run.upstream.port}",
                                  "--models-from", f"a=http://127.0.0.1:{run.upstream.port}", "--drain-timeout", "10"],
                                 stderr=subprocess.PIPE, text=True)
        try:
            deadline = time.monotonic() + 30
            while port_free(port):
                assert front.poll() is None and time.monotonic() < deadline, front.stderr.read()
                time.sleep(0.05)
            assert requests.get(f"http://127.0.0.1:{port}/v1/models", timeout=10).json() == MODELS
            outcome = {}
            slow = threading.Thread(target=lambda: outcome.update(
                slow=requests.get(f"http://127.0.0.1:{port}/slow?s=2", timeout=30)))
            slow.start()
            time.sleep(0.5)
            front.send_signal(signal.SIGTERM)
            time.sleep(0.3)
            assert openai_error(requests.get(f"http://127.0.0.1:{port}/health", timeout=10), 503)
            assert front.wait(10) == 0
            slow.join(10)
            assert outcome["slow"].status_code == 200
            log = front.stderr.read()
            assert "draining, 1 in flight (up to 10 s)" in log and "cut off" not in log, log
        finally:
            if front.poll() is None:
                front.kill()
                front.wait(10)
        assert port_free(port)


def test_an_upstream_answering_garbage_is_a_502_naming_it():
    async def garbage(reader, writer):
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"SPDY/9 lol\r\n\r\n")
        await writer.drain()
        writer.close()

    with running(BASE + 20, upstream_port=BASE + 23) as run:
        server = run.call(asyncio.start_server(garbage, "127.0.0.1", BASE + 23, reuse_address=True))
        try:
            error = openai_error(requests.get(f"{run.url}/v1/completions", timeout=10), 502)
            assert error["message"].startswith("the router answered something that "
                                               "is not HTTP/1.1"), error
        finally:
            server.close()
            run.call(server.wait_closed())
