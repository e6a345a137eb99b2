"""The front as the launcher plans it: one more process of a deployment, started last, stopped first."""

from __future__ import annotations

import dataclasses
import ipaddress
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from pdserve.front.config import Limits, limit_flag
from pdserve.launch.instance import HOST, InstanceSpec
from pdserve.launch.process import ProcessSpec

DRAIN_GRACE_S = 5.0  # beyond its drain timeout, how long the launcher waits for the front to exit


@dataclass(frozen=True)
class FrontSpec:
    """A front listening on `host`:`port`, forwarding to `upstream` (name, URL: the router, or the
    only instance); GET /v1/models is asked of `model_sources` (instance name, URL) in order.
    `direct_sources`: the instances (name, URL) that answer alone the requests a PD router's merge
    answers wrong (PD's decode instances; none where the upstream answers every request itself).
    `drain_timeout`: after SIGTERM, how long requests in flight may take. `limits`: what one client
    may hold of it (config.Limits). `fallback_sources`: every instance (name, URL) behind a router,
    in the order the front prefers them for whole requests while another is down or the router
    failed; none where the upstream is the only instance."""

    port: int
    upstream: tuple[str, str]
    model_sources: tuple[tuple[str, str], ...]
    drain_timeout: float = 30.0
    name: str = "front"
    host: str = HOST
    direct_sources: tuple[tuple[str, str], ...] = ()
    limits: Limits = Limits()
    fallback_sources: tuple[tuple[str, str], ...] = ()

    @property
    def url(self) -> str:
        """Where this host's clients (and the launcher's health check) reach it."""
        return f"http://{_reachable(self.host)}:{self.port}"

    def process_spec(self, run_dir: Path) -> ProcessSpec:
        argv = [sys.executable, "-m", "pdserve.front", "--host", self.host, "--port", str(self.port),
                "--upstream", "=".join(self.upstream), "--drain-timeout", str(self.drain_timeout)]
        for source in self.model_sources:
            argv += ["--models-from", "=".join(source)]
        for source in self.direct_sources:
            argv += ["--direct-to", "=".join(source)]
        for source in self.fallback_sources:
            argv += ["--fallback-to", "=".join(source)]
        for field in dataclasses.fields(Limits):
            argv += [limit_flag(field.name), str(getattr(self.limits, field.name))]
        return ProcessSpec(self.name, tuple(argv), {}, run_dir / f"{self.name}.log", f"{self.url}/health")


def direct_sources(instances: Iterable[InstanceSpec]) -> tuple[tuple[str, str], ...]:
    """A deployment's instances that answer a whole request alone behind a PD router: its decode
    instances, (name, URL); none in a deployment without them."""
    return tuple((i.name, i.url) for i in instances if i.role == "decode")


def fallback_sources(instances: Iterable[InstanceSpec]) -> tuple[tuple[str, str], ...]:
    """Every instance (name, URL), in the order the front prefers them for whole requests: decode
    instances first (a request's tokens are generated there), then prefill, then any other."""
    rank = {"decode": 0, "prefill": 1}
    return tuple((i.name, i.url) for i in sorted(instances, key=lambda i: rank.get(i.role, 2)))


def _reachable(host: str) -> str:
    """A listen address as a client on this host dials it: a wildcard is reached on loopback."""
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return host  # a host name
    if address.is_unspecified:
        return HOST if address.version == 4 else "[::1]"
    return f"[{host}]" if address.version == 6 else host
