"""One exchange with an upstream, below the front's handler (exchange.py): the request body sent
whole or piece by piece, an answer read whole within a bound, and what a failure before the
response head means: resent elsewhere where it left nothing running upstream (Unanswered), else
answered in OpenAI's shape, the upstream named and its address only logged."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import AsyncIterator

import aiohttp
from multidict import CIMultiDict

from pdserve.front.body import RequestBody
from pdserve.front.config import Upstream
from pdserve.front.openai_error import ErrorBody, OpenAIError

logger = logging.getLogger("pdserve.front.exchange")  # its lines are the exchange's, as they were

# not 504: a router's gateway timeout may leave its instance computing the request
RESENT_STATUSES = frozenset({500, 502, 503})
MAX_ERROR_BODY_BYTES = 1 << 20  # error bodies and /v1/models answers, read whole
UPLOAD_WHOLE_BYTES = 1 << 20  # a larger request body is sent upstream piece by piece (upload)


class TooLarge(Exception):
    """An answer read whole (read_bounded) was longer than its bound."""


class Unanswered(Exception):
    """`upstream` failed before anything reached the client, and left nothing running there:
    resending the request elsewhere runs it once. `reason` labels the resend's count; `answer` is
    the client's answer where nothing is resent."""

    def __init__(self, upstream: Upstream, reason: str, what: str, answer: OpenAIError | ErrorBody) -> None:
        super().__init__(what)
        self.upstream = upstream
        self.reason = reason
        self.what = what
        self.answer = answer


def resend_reason(exc: BaseException) -> str | None:
    """Why a failure before the response head leaves nothing running upstream; None where it may not
    (a silent upstream may still be computing)."""
    if isinstance(exc, aiohttp.ClientConnectorError | aiohttp.ConnectionTimeoutError):
        return "connect"
    if isinstance(exc, TimeoutError):
        return None
    if isinstance(exc, aiohttp.ServerDisconnectedError | aiohttp.ClientOSError):
        return "disconnected"
    return None


def error_message(error: ErrorBody) -> str:
    return json.loads(error.body)["error"]["message"]  # from_upstream made it OpenAI's shape


def client_error(upstream: Upstream, exc: BaseException, idle_timeout: float) -> OpenAIError:
    """What the client is told when `upstream` failed before its response head: named, its address
    only logged (a client is not told the deployment's internal addresses)."""
    logger.warning("front: the %s at %s failed: %r", upstream.name, upstream.url, exc)
    where = f"the {upstream.name}"
    if isinstance(exc, aiohttp.ClientConnectorError):
        cause = os.strerror(exc.os_error.errno) if exc.os_error.errno else type(exc.os_error).__name__
        return OpenAIError(502, f"{where} is unreachable ({cause})")
    if isinstance(exc, TimeoutError):
        return OpenAIError(504, f"{where} sent no answer in {idle_timeout:.0f} s")
    if isinstance(exc, aiohttp.ServerDisconnectedError):
        return OpenAIError(502, f"{where} closed the connection without answering")
    if isinstance(exc, aiohttp.ClientResponseError):
        return OpenAIError(502, f"{where} answered something that is not HTTP/1.1: {exc.message}")
    if isinstance(exc, TooLarge):
        return OpenAIError(502, f"{where} answered more than {MAX_ERROR_BODY_BYTES} bytes")
    return OpenAIError(502, f"{where} failed: {type(exc).__name__}")


def upload(body: RequestBody, headers: CIMultiDict[str]) -> bytes | bytearray | aiohttp.Payload | None:
    """What aiohttp sends as `body`: whole if small; else piece by piece with its length in `headers`,
    so that neither a copy of it nor more than a piece waits in a send buffer."""
    if body.num_bytes <= UPLOAD_WHOLE_BYTES:
        return body.raw or None

    async def pieces() -> AsyncIterator[bytes | memoryview]:
        for piece in body.pieces():
            yield piece

    headers["Content-Length"] = str(body.num_bytes)
    return aiohttp.AsyncIterablePayload(pieces())


async def read_bounded(content: aiohttp.StreamReader, limit: int) -> bytes:
    body = bytearray()
    while chunk := await content.readany():
        body += chunk
        if len(body) > limit:
            raise TooLarge()
    return bytes(body)
