"""What one front process serves: where it listens, where requests go, what a client may hold of it."""

from __future__ import annotations

import dataclasses
import urllib.parse
from dataclasses import dataclass

from pdserve.errors import ConfigError


@dataclass(frozen=True)
class Upstream:
    """A server the front forwards to, named for messages ("router", "decode")."""

    name: str
    host: str
    port: int

    @classmethod
    def parse(cls, name: str, url: str) -> Upstream:
        parts = urllib.parse.urlsplit(url)
        if parts.scheme != "http" or not parts.hostname or parts.port is None or parts.path not in ("", "/"):
            raise ConfigError(f"{name} URL {url!r} is not http://HOST:PORT")
        return cls(name, parts.hostname, parts.port)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


@dataclass(frozen=True)
class Limits:
    """What one client may hold of the front.

    max_connections: client connections served at once; one more waits up to `connection_wait`
    seconds for a free one (at most max_connections wait), then is answered 503.
    max_header_bytes / max_headers: the longest request line or header line, and how many header
    lines (a longer head is answered 400). max_body_bytes: the largest request body (413).
    max_body_bytes_in_flight: all the request bodies the front holds at once, from their first byte
    to the end of their request (one more is answered 503 before it is read).
    head_timeout: from a connection's opening, or the end of its previous response, how long it has
    to send a complete request head; it is closed after that (a slow or idle client).
    body_timeout: from the end of the head, how long the whole request body may take (408).
    busy_body_timeout: the same once the connection slots near their limit (7/8 held, or one
    waiting), for the bodies then arriving too: slow senders cannot hold every slot (the shorter of
    the two holds).
    idle_timeout: the longest silence from the upstream, before its response head (a prefill
    computing) and between two pieces of its body, and the longest a client may take to accept one
    piece; a stream as such has no deadline.
    """

    max_connections: int = 1024
    connection_wait: float = 1.0
    max_header_bytes: int = 8190
    max_headers: int = 100
    max_body_bytes: int = 16 << 20
    max_body_bytes_in_flight: int = 64 << 20
    head_timeout: float = 5.0
    body_timeout: float = 60.0
    busy_body_timeout: float = 2.0
    idle_timeout: float = 600.0

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            if not getattr(self, field.name) > 0:
                raise ConfigError(f"front limit {field.name} must be positive, got {getattr(self, field.name)}")
        if self.connection_wait >= self.head_timeout:
            raise ConfigError(f"front limit connection_wait ({self.connection_wait} s) must be shorter than "
                              f"head_timeout ({self.head_timeout} s)")
        if self.max_body_bytes > self.max_body_bytes_in_flight:
            raise ConfigError(f"front limit max_body_bytes ({self.max_body_bytes}) must not be over "
                              f"max_body_bytes_in_flight ({self.max_body_bytes_in_flight})")


def limit_flag(name: str) -> str:
    """The front's command-line flag for the Limits field `name`."""
    return "--" + name.replace("_", "-")


@dataclass(frozen=True)
class FrontConfig:
    """upstream: where requests go (the router, or the only instance). model_sources: the
    instances, asked in order for GET /v1/models. direct_sources: instances that answer a whole
    request alone (PD's decode instances), for the requests a PD router's merge answers wrong
    (routes.py); empty where the upstream answers every request itself. drain_timeout: after
    SIGTERM, how long requests in flight may take to finish. fallback_sources: every instance
    behind a PD router, decode instances first, each able to serve a whole request alone: while
    one is down requests go to the live ones instead of the router, and a request the router fails
    before its first byte is resent to one (instances.py); empty where the upstream is the only
    instance."""

    host: str
    port: int
    upstream: Upstream
    model_sources: tuple[Upstream, ...]
    direct_sources: tuple[Upstream, ...] = ()
    drain_timeout: float = 30.0
    limits: Limits = Limits()
    fallback_sources: tuple[Upstream, ...] = ()

    def __post_init__(self) -> None:
        if not self.model_sources:
            raise ConfigError("the front needs at least one instance to ask for /v1/models")
        if self.drain_timeout < 0:
            raise ConfigError(f"front drain timeout must be 0 or more, got {self.drain_timeout}")
