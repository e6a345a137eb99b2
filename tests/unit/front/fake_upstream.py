"""A fake upstream for front tests, answering the way vllm-router and vLLM do (over kept-alive
connections it counts), a raw one answering fixed bytes, and a loop thread that runs them and a
FrontServer together on real sockets (fakes can be stopped and started again: a dead instance)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field

from aiohttp import web

from pdserve.front.config import FrontConfig, Limits, Upstream
from pdserve.front.server import FrontServer

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


@dataclass
class FakeUpstream:
    """Routes: /health, /v1/models, /echo and /v1/completions (the request as it arrived: method,
    target, headers, body, and this upstream's name), /stream?n=&gap=&pad= (chunked SSE, one event per `gap` s,
    each `pad` bytes longer), /slow?s=,
    /vllm-404, /empty-404, /chunked-503, ROUTER_TEXT. With `status` set, every request but /health
    is answered with it, as vllm-router answers when the worker it picked failed."""

    port: int
    name: str = "upstream"
    requests: list[str] = field(default_factory=list)  # every request's method and target
    peers: set = field(default_factory=set)  # the (host, port) of every connection a request came on
    num_streams_cancelled: int = 0  # /stream requests whose client (the front) went away mid-stream
    num_slow_cancelled: int = 0  # /slow requests whose client went away before the answer
    status: int | None = None
    # with this set, a streamed POST /v1/completions is answered with these SSE events and [DONE]
    completion_events: list[bytes] | None = None
    bodies: list[bytes] = field(default_factory=list)  # the body of every POST /v1/completions
    health_delay: float = 0.0  # how long GET /health takes to answer

    @property
    def served(self) -> list[str]:
        """The requests other than health probes."""
        return [each for each in self.requests if each != "GET /health"]

    async def handle(self, request: web.BaseRequest) -> web.StreamResponse:
        self.requests.append(f"{request.method} {request.raw_path}")
        self.peers.add(request.transport.get_extra_info("peername"))
        path, query = request.path, request.query
        if self.status is not None and path != "/health":
            return web.Response(status=self.status, text=f"Decode server error: {self.status}")
        if path == "/health" and self.health_delay:
            await asyncio.sleep(self.health_delay)
        if path in ("/health", "/v1/models"):
            return web.json_response(MODELS) if path == "/v1/models" else web.Response(text="ok")
        if path == "/v1/completions":
            self.bodies.append(await request.read())
            if self.completion_events is not None and json.loads(self.bodies[-1]).get("stream"):
                response = web.StreamResponse(headers={"content-type": "text/event-stream"})
                response.enable_chunked_encoding()
                await response.prepare(request)
                for event in self.completion_events:
                    await response.write(event)
                await response.write(b"data: [DONE]\n\n")
                await response.write_eof()
                return response
        if path in ("/echo", "/v1/completions"):
            body = await request.read()
            return web.json_response({"method": request.method, "target": request.raw_path, "upstream": self.name,
                                      "headers": [[k.decode("latin-1"), v.decode("latin-1")]
                                                  for k, v in request.raw_headers],
                                      "body": body.decode("latin-1")})
        if path == "/stream":
            response = web.StreamResponse(headers={"content-type": "text/event-stream"})
            response.enable_chunked_encoding()
            await response.prepare(request)
            padding = {"pad": "x" * int(query["pad"])} if "pad" in query else {}
            try:
                for i in range(int(query.get("n", 3))):
                    await response.write(f"data: {json.dumps({'i': i, **padding})}\n\n".encode())
                    await asyncio.sleep(float(query.get("gap", 0.05)))
            except (asyncio.CancelledError, ConnectionError):
                self.num_streams_cancelled += 1
                raise
            await response.write_eof()
            return response
        if path == "/slow":
            try:
                await asyncio.sleep(float(query.get("s", 1)))
            except asyncio.CancelledError:
                self.num_slow_cancelled += 1
                raise
            return web.json_response({"slept": True})
        if path == "/vllm-404":
            return web.json_response(VLLM_404, status=404)
        if path == "/empty-404":
            return web.Response(status=404, content_type="text/plain")
        if path == "/chunked-503":
            response = web.StreamResponse(status=503, headers={"content-type": "text/plain"})
            response.enable_chunked_encoding()
            await response.prepare(request)
            await response.write(b"No prefill servers available")
            await response.write_eof()
            return response
        status, text = ROUTER_TEXT[path]
        return web.Response(status=status, text=text)


@dataclass
class Running:
    front: FrontServer
    upstream: FakeUpstream
    loop: asyncio.AbstractEventLoop
    direct: list[FakeUpstream]
    instances: dict[str, FakeUpstream] = field(default_factory=dict)  # the front's fallback sources, by name
    runners: dict[int, web.AppRunner] = field(default_factory=dict)  # the fakes serving now, by port

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.front.config.port}"

    def call(self, coro, timeout: float = 30.0):
        """Run `coro` on the loop thread and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def drain_soon(self) -> object:
        """Start the drain on the loop thread; returns a concurrent Future of its result."""
        return asyncio.run_coroutine_threadsafe(self.front.drain(), self.loop)

    def start(self, fake: FakeUpstream) -> None:
        self.runners[fake.port] = self.call(serve_fake(fake))

    def stop(self, fake: FakeUpstream) -> None:
        """Close `fake`'s listener and connections: its port refuses connections, as a killed instance's does."""
        self.call(self.runners.pop(fake.port).cleanup())


async def serve_fake(fake: FakeUpstream) -> web.AppRunner:
    """`fake` listening on 127.0.0.1:fake.port until the runner is cleaned up."""
    runner = web.ServerRunner(web.Server(fake.handle, handler_cancellation=True), handle_signals=False,
                              access_log=None, shutdown_timeout=1.0)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", fake.port, reuse_address=True).start()
    return runner


async def serve_raw(port: int, reply: bytes, hold_s: float = 0.0) -> asyncio.Server:
    """A server on `port` that reads each request (head and Content-Length body), writes `reply`,
    waits up to `hold_s` for the client to close, and closes the connection: b"" closes without
    answering."""
    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                       if line.lower().startswith(b"content-length:")), 0)
        await reader.readexactly(length)
        writer.write(reply)
        await writer.drain()
        with suppress(TimeoutError):
            async with asyncio.timeout(hold_s):
                await reader.read()
        writer.close()

    return await asyncio.start_server(answer, "127.0.0.1", port, reuse_address=True)


@contextmanager
def running(port: int, drain_timeout: float = 5.0, models_from: tuple[int, ...] = (), upstream_port: int | None = None,
            direct: tuple[int, ...] = (), instances: tuple[tuple[str, int], ...] = (), **limits) -> Iterator[Running]:
    """A FakeUpstream on port+1 and a FrontServer on `port` in front of it (or of `upstream_port`),
    asking `models_from` ports (default: the fake) for /v1/models, with FakeUpstreams named
    "direct<port>" as its direct sources on `direct` ports, FakeUpstreams named and placed as
    `instances` (name, port) as its fallback sources, and `limits` (Limits fields, idle_timeout
    10 s unless given); stopped and closed afterwards."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="front-test-loop", daemon=True)
    thread.start()
    fake = FakeUpstream(port + 1)
    direct_fakes = [FakeUpstream(p, f"direct{p}") for p in direct]
    instance_fakes = {name: FakeUpstream(p, name) for name, p in instances}
    sources = tuple(Upstream(f"instance{p}", "127.0.0.1", p) for p in (models_from or (fake.port,)))
    config = FrontConfig("127.0.0.1", port, Upstream("router", "127.0.0.1", upstream_port or fake.port), sources,
                         tuple(Upstream(f.name, "127.0.0.1", f.port) for f in direct_fakes), drain_timeout,
                         dataclasses.replace(Limits(idle_timeout=10.0), **limits),
                         fallback_sources=tuple(Upstream(f.name, "127.0.0.1", f.port) for f in instance_fakes.values()))
    front = FrontServer(config)
    run = Running(front, fake, loop, direct_fakes, instance_fakes)
    try:
        for each in (fake, *direct_fakes, *instance_fakes.values()):
            run.start(each)
        run.call(front.start())
        yield run
    finally:
        if front.state.value == "serving":
            run.call(front.drain())
        for runner in run.runners.values():
            run.call(runner.cleanup())
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()
