"""One request through the front: forwarded to its upstream byte for byte, or answered here.

    GET /v1/models   asked of the instances in turn (vllm-router's PD discovery mode has no
                     instance of its own to ask, and answers 503 "No prefill servers available")
    anything else    sent to the upstream; a success is copied back as it streams, an error is
                     read whole and sent back in OpenAI's shape (openai_error.from_upstream)

The caller owns the client connection and closes it afterwards; `Connection: close` on both legs
means one request per connection, so the response ends when the upstream's connection does.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass

from pdserve.launch.front.config import Upstream
from pdserve.launch.front.http1 import (
    MAX_HEAD_BYTES,
    HttpProtocolError,
    RequestHead,
    ResponseHead,
    copy,
    read_body,
    read_response_head,
    response_bytes,
)
from pdserve.launch.front.openai_error import OpenAIError, from_upstream

CONNECT_TIMEOUT = 10.0
MODELS_PATH = "/v1/models"


@dataclass(frozen=True)
class Client:
    """The client's side of the exchange."""

    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter

    async def send(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()


class UpstreamFailed(Exception):
    """The upstream could not be reached or broke off before its response head (internal to this module)."""


async def handle(request: RequestHead, client: Client, upstream: Upstream, model_sources: tuple[Upstream, ...],
                 idle_timeout: float) -> None:
    """Answer `request` (its head already read from `client`)."""
    if request.method == "GET" and request.path == MODELS_PATH:
        await _models(request, client, model_sources, idle_timeout)
    else:
        await _forward(request, client, upstream, idle_timeout)


async def _connect(upstream: Upstream) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    try:
        async with asyncio.timeout(CONNECT_TIMEOUT):
            return await asyncio.open_connection(upstream.host, upstream.port, limit=MAX_HEAD_BYTES)
    except (OSError, TimeoutError) as exc:
        raise UpstreamFailed(f"the {upstream.name} at {upstream.url} is unreachable: {exc or 'timed out'}") from exc


async def _response_head(reader: asyncio.StreamReader, upstream: Upstream, idle_timeout: float,
                         client: Client) -> ResponseHead:
    """The final response head; interim (1xx) ones, e.g. 100 Continue, are passed to the client."""
    while True:
        try:
            async with asyncio.timeout(idle_timeout):
                head = await read_response_head(reader)
        except asyncio.IncompleteReadError:
            raise UpstreamFailed(f"the {upstream.name} at {upstream.url} closed the connection without "
                                 "answering") from None
        except TimeoutError:
            raise UpstreamFailed(f"the {upstream.name} at {upstream.url} sent no answer in "
                                 f"{idle_timeout:.0f} s") from None
        except HttpProtocolError as exc:
            raise UpstreamFailed(f"the {upstream.name} at {upstream.url} answered {exc}") from None
        if head.status >= 200 or head.status == 101:
            return head
        await client.send(head.encode(close=False))


async def _forward(request: RequestHead, client: Client, upstream: Upstream, idle_timeout: float) -> None:
    try:
        reader, writer = await _connect(upstream)
    except UpstreamFailed as exc:
        await client.send(OpenAIError(502, str(exc)).response())
        return
    tasks: list[asyncio.Task] = []
    try:
        writer.write(request.encode())
        tasks.append(asyncio.create_task(copy(client.reader, writer, request.body_length(), idle_timeout)))
        tasks.append(asyncio.create_task(_response_head(reader, upstream, idle_timeout, client)))
        body, answer = tasks
        while not answer.done():
            await asyncio.wait([t for t in tasks if not t.done()], return_when=asyncio.FIRST_COMPLETED)
            if body.done() and body.exception() is not None and not answer.done():
                raise body.exception()  # the client broke off its request body: nothing to answer
        try:
            head = answer.result()
        except UpstreamFailed as exc:
            await client.send(OpenAIError(502, str(exc)).response())
            return
        if head.status >= 400:
            async with asyncio.timeout(idle_timeout):
                body_bytes = await read_body(reader, head, request.method)
            error = from_upstream(head.status, body_bytes, f"{request.method} {request.path}")
            await client.send(error.response())
            return
        await client.send(head.encode())
        await copy(reader, client.writer, head.body_length(request.method), idle_timeout)
    finally:
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        writer.close()


async def _models(request: RequestHead, client: Client, sources: tuple[Upstream, ...], idle_timeout: float) -> None:
    failures = []
    for source in sources:
        try:
            head, body = await _fetch(request, source, idle_timeout, client)
        except (UpstreamFailed, HttpProtocolError, asyncio.IncompleteReadError, TimeoutError) as exc:
            failures.append(f"{source.name}: {exc}")
            continue
        if head.status == 200:
            await client.send(response_bytes(200, "OK", head.header("content-type") or "application/json", body))
            return
        failures.append(f"{source.name}: HTTP {head.status}")
    await client.send(OpenAIError(503, f"no instance answered GET {MODELS_PATH} ({'; '.join(failures)})").response())


async def _fetch(request: RequestHead, source: Upstream, idle_timeout: float,
                 client: Client) -> tuple[ResponseHead, bytes]:
    """GET the request's target from `source`, response read whole."""
    reader, writer = await _connect(source)
    try:
        writer.write(RequestHead("GET", request.target, _without_body(request)).encode())
        head = await _response_head(reader, source, idle_timeout, client)
        async with asyncio.timeout(idle_timeout):
            return head, await read_body(reader, head, "GET")
    finally:
        writer.close()


def _without_body(request: RequestHead) -> tuple[tuple[str, str], ...]:
    return tuple((k, v) for k, v in request.headers if k.lower() not in ("content-length", "transfer-encoding"))
