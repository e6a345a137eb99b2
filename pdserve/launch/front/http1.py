"""HTTP/1.1 as much as the front needs: parse and re-encode message heads, frame and read bodies.

Bodies of successful responses are never parsed: the front copies them byte for byte. It sends
every request upstream with `Connection: close` and answers every client the same way, so a body
without a length ends where its connection does, and no connection is ever idle between requests.
Malformed heads raise HttpProtocolError; nothing is guessed at.
"""

from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass

from pdserve.errors import ProtocolError

MAX_HEAD_BYTES = 64 << 10
MAX_BUFFERED_BODY_BYTES = 1 << 20  # error bodies and /v1/models answers, read whole
COPY_BYTES = 64 << 10
_TOKEN = re.compile(r"^[!#$%&'*+\-.^_`|~0-9A-Za-z]+$")
_HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-connection"})
NO_BODY_STATUSES = frozenset({204, 304})

Headers = tuple[tuple[str, str], ...]


class HttpProtocolError(ProtocolError):
    """A client or upstream sent something that is not HTTP/1.1 the front can pass on safely."""


def _header(headers: Headers, name: str) -> str | None:
    values = [v for k, v in headers if k.lower() == name]
    if len(set(values)) > 1:
        raise HttpProtocolError(f"conflicting {name} headers")
    return values[0] if values else None


def _encode(start_line: str, headers: Headers, close: bool) -> bytes:
    kept = [(k, v) for k, v in headers if k.lower() not in _HOP_BY_HOP]
    if close:
        kept.append(("Connection", "close"))
    return "\r\n".join([start_line, *(f"{k}: {v}" for k, v in kept), "", ""]).encode("latin-1")


def _content_length(headers: Headers) -> int | None:
    """The declared body length; None for chunked. Both at once is refused (request smuggling)."""
    length = _header(headers, "content-length")
    chunked = (_header(headers, "transfer-encoding") or "").lower()
    if chunked and length is not None:
        raise HttpProtocolError("both Content-Length and Transfer-Encoding")
    if chunked:
        if chunked.split(",")[-1].strip() != "chunked":
            raise HttpProtocolError(f"unsupported Transfer-Encoding {chunked!r}")
        return None
    if length is None:
        return 0
    if not length.isascii() or not length.isdigit():
        raise HttpProtocolError(f"bad Content-Length {length!r}")
    return int(length)


@dataclass(frozen=True)
class RequestHead:
    """A request line and its headers, as the client sent them."""

    method: str
    target: str
    headers: Headers

    @property
    def path(self) -> str:
        return self.target.split("?", 1)[0]

    def body_length(self) -> int | None:
        """Bytes of body that follow the head: a count, or None for a chunked body."""
        return _content_length(self.headers)

    def encode(self) -> bytes:
        return _encode(f"{self.method} {self.target} HTTP/1.1", self.headers, close=True)


@dataclass(frozen=True)
class ResponseHead:
    """A status line and its headers."""

    status: int
    reason: str
    headers: Headers

    def header(self, name: str) -> str | None:
        return _header(self.headers, name.lower())

    def body_length(self, request_method: str) -> int | None:
        """Bytes of body that follow: a count, or None when it runs to the end of the connection
        (chunked or unframed; the front asked for `Connection: close`)."""
        if request_method == "HEAD" or self.status in NO_BODY_STATUSES or self.status < 200:
            return 0
        chunked = (self.header("transfer-encoding") or "").lower()
        if chunked or self.header("content-length") is None:
            return None
        return _content_length(self.headers)

    def encode(self, close: bool = True) -> bytes:
        return _encode(f"HTTP/1.1 {self.status} {self.reason}", self.headers, close)


def response_bytes(status: int, reason: str, content_type: str, body: bytes) -> bytes:
    """A complete response that closes the connection."""
    head = ResponseHead(status, reason, (("Content-Type", content_type), ("Content-Length", str(len(body)))))
    return head.encode() + body


async def _read_head(reader: asyncio.StreamReader) -> list[str]:
    try:
        raw = await reader.readuntil(b"\r\n\r\n")
    except asyncio.LimitOverrunError:
        raise HttpProtocolError(f"message head longer than {MAX_HEAD_BYTES} bytes") from None
    return raw[:-4].decode("latin-1").split("\r\n")


def _parse_headers(lines: list[str]) -> Headers:
    headers = []
    for line in lines:
        name, sep, value = line.partition(":")
        if not sep or not _TOKEN.match(name):
            raise HttpProtocolError(f"malformed header line {line[:80]!r}")
        headers.append((name, value.strip(" \t")))
    return tuple(headers)


async def read_request_head(reader: asyncio.StreamReader) -> RequestHead:
    """The next request head; IncompleteReadError if the client closed before sending one."""
    line, *rest = await _read_head(reader)
    parts = line.split(" ")
    if len(parts) != 3 or not _TOKEN.match(parts[0]) or parts[2] not in ("HTTP/1.1", "HTTP/1.0"):
        raise HttpProtocolError(f"malformed request line {line[:80]!r}")
    head = RequestHead(parts[0], parts[1], _parse_headers(rest))
    head.body_length()  # framing checked before anything is forwarded
    return head


async def read_response_head(reader: asyncio.StreamReader) -> ResponseHead:
    line, *rest = await _read_head(reader)
    version, _, status_reason = line.partition(" ")
    status, _, reason = status_reason.partition(" ")
    if not version.startswith("HTTP/1.") or len(status) != 3 or not status.isdigit():
        raise HttpProtocolError(f"malformed status line {line[:80]!r}")
    return ResponseHead(int(status), reason, _parse_headers(rest))


async def copy(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, length: int | None,
               idle_timeout: float) -> None:
    """Copy `length` bytes (None: until end of stream) as they arrive; TimeoutError when nothing
    arrives for `idle_timeout` seconds."""
    remaining = length
    while remaining is None or remaining > 0:
        async with asyncio.timeout(idle_timeout):
            data = await reader.read(COPY_BYTES if remaining is None else min(COPY_BYTES, remaining))
        if not data:
            if remaining:
                raise HttpProtocolError(f"connection closed {remaining} bytes before the end of the body")
            return
        writer.write(data)
        await writer.drain()
        if remaining is not None:
            remaining -= len(data)


async def read_body(reader: asyncio.StreamReader, head: ResponseHead, method: str) -> bytes:
    """A whole response body (chunked decoded), at most MAX_BUFFERED_BODY_BYTES."""
    chunked = (head.header("transfer-encoding") or "").lower() == "chunked"
    if chunked:
        return await _read_chunked(reader)
    length = head.body_length(method)
    if length is None:
        body = await reader.read(MAX_BUFFERED_BODY_BYTES + 1)
        while body and len(body) <= MAX_BUFFERED_BODY_BYTES and (more := await reader.read(COPY_BYTES)):
            body += more
    else:
        if length > MAX_BUFFERED_BODY_BYTES:
            raise HttpProtocolError(f"body of {length} bytes is over the {MAX_BUFFERED_BODY_BYTES} byte limit")
        body = await reader.readexactly(length)
    if len(body) > MAX_BUFFERED_BODY_BYTES:
        raise HttpProtocolError(f"body over the {MAX_BUFFERED_BODY_BYTES} byte limit")
    return body


async def _read_chunked(reader: asyncio.StreamReader) -> bytes:
    body = b""
    while True:
        size_line = (await reader.readuntil(b"\r\n"))[:-2].split(b";", 1)[0].strip()
        try:
            size = int(size_line, 16)
        except ValueError:
            raise HttpProtocolError(f"bad chunk size {size_line[:20]!r}") from None
        if size == 0:
            while await reader.readuntil(b"\r\n") != b"\r\n":  # trailers, ignored
                pass
            return body
        if len(body) + size > MAX_BUFFERED_BODY_BYTES:
            raise HttpProtocolError(f"body over the {MAX_BUFFERED_BODY_BYTES} byte limit")
        body += await reader.readexactly(size)
        if await reader.readexactly(2) != b"\r\n":
            raise HttpProtocolError("chunk not followed by CRLF")
