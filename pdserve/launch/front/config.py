"""What one front process serves: where it listens, where requests go, how long it drains."""

from __future__ import annotations

import urllib.parse
from dataclasses import dataclass

from pdserve.errors import ConfigError


@dataclass(frozen=True)
class Upstream:
    """A server the front forwards to, named for messages ("router", "prefill")."""

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
class FrontConfig:
    """upstream: where every request goes (the router, or the only instance). model_sources:
    the instances, asked in order for GET /v1/models. drain_timeout: after SIGTERM, how long
    requests in flight may take to finish. idle_timeout: the longest silence tolerated from
    either side of a request in flight (an upstream still computing a prefill sends nothing)."""

    host: str
    port: int
    upstream: Upstream
    model_sources: tuple[Upstream, ...]
    drain_timeout: float = 30.0
    idle_timeout: float = 600.0

    def __post_init__(self) -> None:
        if not self.model_sources:
            raise ConfigError("the front needs at least one instance to ask for /v1/models")
        if self.drain_timeout < 0 or self.idle_timeout <= 0:
            raise ConfigError(f"bad front timeouts: drain {self.drain_timeout}, idle {self.idle_timeout}")
