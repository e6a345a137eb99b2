"""A fake upstream for front tests, answering the way vllm-router and vLLM do, and a loop thread
that runs it and a FrontServer together on real sockets."""

from __future__ import annotations

import asyncio
import json
import threading
import urllib.parse
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from pdserve.launch.front.config import FrontConfig, Upstream
from pdserve.launch.front.server import FrontServer

MODELS = {"object": "list", "data": [{"id": "/models/tiny", "object": "model"}]}
VLLM_404 = {"error": {"message": "The model `nope` does not exist.", "type": "NotFoundError", "param": None,
                      "code": 404}}
# what vllm-router 0.1.17 answers, word for word
ROUTER_TEXT = {
    "/router-422": (422, "Failed to deserialize the JSON body into the target type: missing field `model` at "
                         "line 1 column 2"),
    "/router-400": (400, "Failed to parse the request body as JSON: expected value at line 1 column 1"),
    "/wrapped-404": (404, "Prefill server error (404 Not Found): " + json.dumps(VLLM_404)),
    "/no-workers": (503, "No workers available via service discovery: 0 prefill, 0 decode"),
}


def _response(status: int, body: bytes, content_type: str = "application/json", extra: str = "") -> bytes:
    return (f"HTTP/1.1 {status} X\r\ncontent-type: {content_type}\r\ncontent-length: {len(body)}\r\n{extra}\r\n"
            ).encode() + body


@dataclass
class FakeUpstream:
    """Routes: /health, /v1/models, /echo (the request as it arrived: head and body), /stream?n=&gap=
    (chunked SSE, one event per `gap` s), /slow?s=, /vllm-404, /empty-404, /chunked-503, ROUTER_TEXT."""

    port: int
    requests: list[bytes] = field(default_factory=list)  # every request head received
    tasks: set = field(default_factory=set)  # connections being answered

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.tasks.add(asyncio.current_task())
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            self.requests.append(head)
            line, *headers = head.decode("latin-1").split("\r\n")
            method, target, _ = line.split(" ")
            url = urllib.parse.urlsplit(target)
            query = dict(urllib.parse.parse_qsl(url.query))
            lower = {h.split(":", 1)[0].lower(): h.split(":", 1)[1].strip() for h in headers if ":" in h}
            writer.write(await self._answer(method, url.path, query, lower, head, reader, writer))
            await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass  # the front went away first (a request cut off on purpose)
        finally:
            self.tasks.discard(asyncio.current_task())
            writer.close()

    async def close(self, server: asyncio.Server) -> None:
        server.close()
        for task in list(self.tasks):
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        await server.wait_closed()

    async def _answer(self, method, path, query, headers, head, reader, writer) -> bytes:
        if path in ("/health", "/v1/models"):
            return _response(200, json.dumps(MODELS).encode() if path == "/v1/models" else b"ok")
        if path == "/echo":
            if "content-length" in headers:
                body = await reader.readexactly(int(headers["content-length"]))
            else:
                body = await reader.readuntil(b"0\r\n\r\n")
            return _response(200, json.dumps({"head": head.decode("latin-1"), "body": body.decode("latin-1")}).encode())
        if path == "/continue":
            writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            body = await reader.readexactly(int(headers["content-length"]))
            return _response(200, body)
        if path == "/stream":
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
            for i in range(int(query.get("n", 3))):
                event = f"data: {json.dumps({'i': i})}\n\n".encode()
                writer.write(f"{len(event):x}\r\n".encode() + event + b"\r\n")
                await writer.drain()
                await asyncio.sleep(float(query.get("gap", 0.05)))
            return b"0\r\n\r\n"
        if path == "/slow":
            await asyncio.sleep(float(query.get("s", 1)))
            return _response(200, b'{"slept": true}')
        if path == "/vllm-404":
            return _response(404, json.dumps(VLLM_404).encode())
        if path == "/empty-404":
            return _response(404, b"", "text/plain")
        if path == "/chunked-503":
            text = b"No prefill servers available"
            return (b"HTTP/1.1 503 X\r\ncontent-type: text/plain\r\ntransfer-encoding: chunked\r\n\r\n"
                    + f"{len(text):x}\r\n".encode() + text + b"\r\n0\r\n\r\n")
        status, text = ROUTER_TEXT[path]
        return _response(status, text.encode(), "text/plain; charset=utf-8")


@dataclass
class Running:
    front: FrontServer
    upstream: FakeUpstream
    loop: asyncio.AbstractEventLoop

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.front.config.port}"

    def call(self, coro, timeout: float = 30.0):
        """Run `coro` on the loop thread and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def drain_soon(self) -> object:
        """Start the drain on the loop thread; returns a concurrent Future of its result."""
        return asyncio.run_coroutine_threadsafe(self.front.drain(), self.loop)


@contextmanager
def running(port: int, drain_timeout: float = 5.0, models_from: tuple[int, ...] = (), idle_timeout: float = 10.0,
            upstream_port: int | None = None) -> Iterator[Running]:
    """A FakeUpstream on port+1 and a FrontServer on `port` in front of it (or of `upstream_port`),
    asking `models_from` ports (default: the fake) for /v1/models; stopped and closed afterwards."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="front-test-loop", daemon=True)
    thread.start()
    fake = FakeUpstream(port + 1)
    sources = tuple(Upstream(f"instance{p}", "127.0.0.1", p) for p in (models_from or (fake.port,)))
    config = FrontConfig("127.0.0.1", port, Upstream("router", "127.0.0.1", upstream_port or fake.port), sources,
                         drain_timeout, idle_timeout)
    front = FrontServer(config)
    fake_server = asyncio.run_coroutine_threadsafe(
        asyncio.start_server(fake.serve, "127.0.0.1", fake.port, reuse_address=True), loop).result(10)
    run = Running(front, fake, loop)
    try:
        run.call(front.start())
        yield run
    finally:
        if front.state.value == "serving":
            run.call(front.drain())
        run.call(fake.close(fake_server))
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()
