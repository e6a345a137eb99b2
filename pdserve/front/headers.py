"""Which headers cross the front: hop-by-hop ones stay on their own connection (RFC 9110 7.6.1),
and a header value with CR, LF or NUL is refused (its parser already refuses them; this holds
whatever parser aiohttp runs with)."""

from __future__ import annotations

from multidict import CIMultiDict, CIMultiDictProxy

_HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-connection", "proxy-authenticate", "proxy-authorization",
                         "te", "trailer", "transfer-encoding", "upgrade"})
# set again by the front for the body it sends: the request's is re-framed, the target's host is the upstream's
_REFRAMED_REQUEST = frozenset({"host", "content-length", "expect"})
# what pdserve's own processes set between them, never a client: vLLM takes X-Request-ID for its request
# id, which a transfer between P and D is matched by
_INTERNAL_REQUEST = frozenset({"x-request-id"})
_FORBIDDEN_CHARS = ("\r", "\n", "\0")


def _connection_options(headers: CIMultiDictProxy[str]) -> set[str]:
    """The headers a Connection header names: hop-by-hop for this message."""
    return {name.strip().lower() for value in headers.getall("Connection", ()) for name in value.split(",")}


def _kept(headers: CIMultiDictProxy[str], dropped: frozenset[str]) -> CIMultiDict[str]:
    skip = dropped | _connection_options(headers)
    return CIMultiDict((name, value) for name, value in headers.items() if name.lower() not in skip)


def request_headers(headers: CIMultiDictProxy[str]) -> CIMultiDict[str]:
    """A client's request headers as the front sends them upstream (X-Request-ID left out)."""
    return _kept(headers, _HOP_BY_HOP | _REFRAMED_REQUEST | _INTERNAL_REQUEST)


def response_headers(headers: CIMultiDictProxy[str]) -> CIMultiDict[str]:
    """An upstream's response headers as the front relays them (Content-Length kept: the body is copied as is)."""
    return _kept(headers, _HOP_BY_HOP)


def forbidden_header(headers: CIMultiDictProxy[str]) -> str | None:
    """The name of the first header whose value holds CR, LF or NUL, if any."""
    for name, value in headers.items():
        if any(char in value for char in _FORBIDDEN_CHARS):
            return name
    return None
