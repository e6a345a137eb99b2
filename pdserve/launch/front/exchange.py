"""One request through the front: answered here, or forwarded over a kept-alive upstream connection.

    GET /v1/models   asked of the instances in turn (vllm-router's PD discovery mode has no
                     instance of its own to ask, and answers 503 "No prefill servers available")
    anything else    its body read whole (within the body limits, chunked decoded), sent with a
                     Content-Length to the upstream routes.py picks; a success is relayed piece
                     by piece as it arrives, an error read whole and answered in OpenAI's shape
                     (openai_error.from_upstream)
"""

from __future__ import annotations

import asyncio

import aiohttp
import yarl
from aiohttp import web
from aiohttp.web_protocol import RequestPayloadError

from pdserve.launch.front.config import Limits, Upstream
from pdserve.launch.front.headers import forbidden_header, request_headers, response_headers
from pdserve.launch.front.openai_error import OpenAIError, from_upstream
from pdserve.launch.front.routes import Routes

CONNECT_TIMEOUT = 10.0
MODELS_PATH = "/v1/models"
MAX_ERROR_BODY_BYTES = 1 << 20  # error bodies and /v1/models answers, read whole
# vLLM's server (uvicorn) closes a connection idle for 5 s: the pool lets go of it first, so it
# never sends a request on a connection the instance is closing
UPSTREAM_KEEPALIVE_S = 4.0
# A piece this small written to an empty send buffer cannot wait for the client to read (asyncio
# pauses writing at 64 KiB buffered): it is written without a timer, a third of the CPU a relayed
# piece costs
UNBLOCKED_WRITE_BYTES = 16 << 10


class RequestRefused(Exception):
    """The client's request breaks a limit; `error` answers it and the connection closes."""

    def __init__(self, error: OpenAIError) -> None:
        super().__init__(error.message)
        self.error = error


class RelayBrokeOff(Exception):
    """A response failed after its head was relayed (the upstream broke off or went silent, or the
    client stopped reading): only closing the connection tells the client."""


class _TooLarge(Exception):
    pass


def _failure(upstream: Upstream, exc: BaseException, idle_timeout: float) -> OpenAIError:
    """What the client is told when `upstream` failed before its response head."""
    where = f"the {upstream.name} at {upstream.url}"
    if isinstance(exc, aiohttp.ClientConnectorError):
        return OpenAIError(502, f"{where} is unreachable: {exc.os_error}")
    if isinstance(exc, TimeoutError):
        return OpenAIError(504, f"{where} sent no answer in {idle_timeout:.0f} s")
    if isinstance(exc, aiohttp.ServerDisconnectedError):
        return OpenAIError(502, f"{where} closed the connection without answering")
    if isinstance(exc, aiohttp.ClientResponseError):
        return OpenAIError(502, f"{where} answered something that is not HTTP/1.1: {exc.message}")
    if isinstance(exc, _TooLarge):
        return OpenAIError(502, f"{where} answered more than {MAX_ERROR_BODY_BYTES} bytes")
    return OpenAIError(502, f"{where} failed: {exc!r}")


async def _read_bounded(content: aiohttp.StreamReader, limit: int) -> bytes:
    body = bytearray()
    while chunk := await content.readany():
        body += chunk
        if len(body) > limit:
            raise _TooLarge()
    return bytes(body)


class Exchange:
    """The front's request handler, with its pool of connections to the upstreams (open() to close())."""

    def __init__(self, routes: Routes, model_sources: tuple[Upstream, ...], limits: Limits) -> None:
        self._routes = routes
        self._model_sources = model_sources
        self._limits = limits
        self._session: aiohttp.ClientSession | None = None

    async def open(self) -> None:
        connector = aiohttp.TCPConnector(limit=self._limits.max_connections, limit_per_host=0,
                                         keepalive_timeout=UPSTREAM_KEEPALIVE_S)
        timeout = aiohttp.ClientTimeout(total=None, connect=CONNECT_TIMEOUT, sock_read=self._limits.idle_timeout)
        self._session = aiohttp.ClientSession(connector=connector, timeout=timeout, auto_decompress=False,
                                              skip_auto_headers=("Accept", "Accept-Encoding", "User-Agent",
                                                                 "Content-Type"))

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def handle(self, request: web.BaseRequest) -> web.StreamResponse:
        """Answer `request` (its head read; its body not yet)."""
        try:
            if not request.raw_path.startswith("/"):  # absolute-form: the front is not a forward proxy
                raise RequestRefused(OpenAIError(400, f"the request target must be a path, got {request.raw_path[:80]!r}"))
            if (name := forbidden_header(request.headers)) is not None:
                raise RequestRefused(OpenAIError(400, f"header {name} holds a CR, LF or NUL character"))
            if request.method == "GET" and request.path == MODELS_PATH:
                return await self._models(request)
            body = await self._read_body(request)
        except RequestRefused as refused:
            return refused.error.response(close=True)
        return await self._forward(request, body, self._routes.pick(request.method, request.path, body))

    async def _read_body(self, request: web.BaseRequest) -> bytes:
        limit = self._limits.max_body_bytes
        too_large = RequestRefused(OpenAIError(413, f"the request body is over the limit of {limit} bytes"))
        if request.content_length is not None and request.content_length > limit:
            raise too_large
        if (expect := request.headers.get("Expect")) is not None:
            if expect.lower() != "100-continue":
                raise RequestRefused(OpenAIError(417, f"Expect: {expect[:40]!r} is not supported"))
            await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        body = bytearray()
        try:
            async with asyncio.timeout(self._limits.body_timeout):
                while chunk := await request.content.readany():
                    body += chunk
                    if len(body) > limit:
                        raise too_large
        except TimeoutError:
            raise RequestRefused(OpenAIError(408, f"the request body did not arrive within "
                                                  f"{self._limits.body_timeout:g} s")) from None
        except RequestPayloadError as exc:
            raise RequestRefused(OpenAIError(400, f"malformed request body: {exc}")) from None
        return bytes(body)

    async def _forward(self, request: web.BaseRequest, body: bytes, upstream: Upstream) -> web.StreamResponse:
        assert self._session is not None
        url = yarl.URL(upstream.url + request.raw_path, encoded=True)
        try:
            answer = await self._session.request(request.method, url, headers=request_headers(request.headers),
                                                 data=body or None, allow_redirects=False)
        except (aiohttp.ClientError, TimeoutError) as exc:
            return _failure(upstream, exc, self._limits.idle_timeout).response()
        async with answer:
            if answer.status >= 400:
                try:
                    error_body = await _read_bounded(answer.content, MAX_ERROR_BODY_BYTES)
                except (aiohttp.ClientError, TimeoutError, _TooLarge) as exc:
                    return _failure(upstream, exc, self._limits.idle_timeout).response()
                return from_upstream(answer.status, error_body, f"{request.method} {request.path}").response()
            return await self._relay(request, answer)

    async def _relay(self, request: web.BaseRequest, answer: aiohttp.ClientResponse) -> web.StreamResponse:
        response = web.StreamResponse(status=answer.status, reason=answer.reason,
                                      headers=response_headers(answer.headers))
        await response.prepare(request)
        client = request.transport
        assert client is not None
        try:
            async for piece in answer.content.iter_any():
                if client.get_write_buffer_size() == 0 and len(piece) <= UNBLOCKED_WRITE_BYTES:
                    await response.write(piece)  # cannot wait on the client: nothing to time
                else:
                    async with asyncio.timeout(self._limits.idle_timeout):
                        await response.write(piece)
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise RelayBrokeOff(f"{request.method} {request.path}: {exc!r}") from exc
        await response.write_eof()
        return response

    async def _models(self, request: web.BaseRequest) -> web.StreamResponse:
        assert self._session is not None
        failures = []
        for source in self._model_sources:
            try:
                async with self._session.get(f"{source.url}{MODELS_PATH}", headers=request_headers(request.headers)
                                             ) as answer:
                    body = await _read_bounded(answer.content, MAX_ERROR_BODY_BYTES)
            except (aiohttp.ClientError, TimeoutError, _TooLarge) as exc:
                failures.append(f"{source.name}: {_failure(source, exc, self._limits.idle_timeout).message}")
                continue
            if answer.status == 200:
                content_type = answer.headers.get("Content-Type", "application/json")
                return web.Response(body=body, headers={"Content-Type": content_type})
            failures.append(f"{source.name}: HTTP {answer.status}")
        return OpenAIError(503, f"no instance answered GET {MODELS_PATH} ({'; '.join(failures)})").response()
