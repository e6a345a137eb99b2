"""Per-peer choice of transport: shared memory for a peer proven on this host, NIXL otherwise.

The connector's `transport` key picks the policy: `shm` (every peer over shared memory, as before),
`nixl` (every peer over NIXL, same host included) or `auto` (shared memory when the handshake's host
proof holds, see nixl_host.py; NIXL otherwise). Both backends see the same KV memory: it lives in
shm segments (mapped by same-host peers) and is registered with the NIXL agent as DRAM. Each peer
incarnation is attached to exactly one backend, and its transfers go there.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import NamedTuple

from pdserve.errors import ConfigError, TransferError
from pdserve.transport.base import Direction, RegionDescriptor, RegionOps, Transport, TransferHandle, TransferStatus
from pdserve.transport.nixl_agent import NIXL_PACKAGE

logger = logging.getLogger(__name__)

POLICIES = ("auto", "shm", "nixl")


class PeerRoute(NamedTuple):
    """What the handshake learnt about reaching a peer: whether it proved to share our host (and
    why not), and its NIXL agent metadata (empty when it has none)."""

    same_host: bool
    nixl_metadata: bytes = b""
    why_not_same_host: str = ""


class RoutedTransport(Transport):
    """Called like any Transport, except that `attach_peer` takes the peer's route. `nixl` is None
    when NIXL is not installed (only possible with policy `auto` or `shm`)."""

    def __init__(self, policy: str, shm: Transport, nixl: Transport | None):
        if policy not in POLICIES:
            raise ConfigError(f"unknown transport {policy!r} (available: {', '.join(POLICIES)})")
        if policy == "nixl" and nixl is None:
            raise ConfigError(f"transport nixl needs the {NIXL_PACKAGE} package: pip install 'pdserve[nixl]'")
        self.policy = policy
        self._backends = {"shm": shm} if nixl is None else {"shm": shm, "nixl": nixl}
        self._routes: dict[str, str] = {}
        self._attached: list[str] = []  # the backend of each attach since `take_attached`

    @property
    def shm(self) -> Transport:
        return self._backends["shm"]

    def register_region(
        self, region_id: int, address: int, size: int, shm_name: str | None = None
    ) -> RegionDescriptor:
        desc = self.shm.register_region(region_id, address, size, shm_name)
        if "nixl" in self._backends and self.policy != "shm":
            self._backends["nixl"].register_region(region_id, address, size, shm_name)
        return desc

    def local_descriptors(self) -> list[RegionDescriptor]:
        return self.shm.local_descriptors()

    def local_endpoint(self) -> bytes:
        """Our NIXL agent metadata for the handshake reply (empty without NIXL or under policy shm)."""
        nixl = self._backends.get("nixl")
        return nixl.local_endpoint() if nixl is not None and self.policy != "shm" else b""

    def choose(self, route: PeerRoute) -> str:
        """The backend a peer with `route` gets; TransferError when none can reach it."""
        if self.policy == "shm" or (self.policy == "auto" and route.same_host):
            return "shm"
        if "nixl" not in self._backends:
            raise TransferError(f"the peer is not provably on this host ({route.why_not_same_host}) and transport "
                                f"nixl is unavailable: pip install 'pdserve[nixl]'")
        if not route.nixl_metadata:
            raise TransferError("the peer offers no NIXL agent metadata (it runs without NIXL or with transport shm)")
        return "nixl"

    def attach_peer(self, peer_id: str, descriptors: list[RegionDescriptor], route: PeerRoute | None = None) -> None:
        name = self.choose(route or PeerRoute(same_host=False, why_not_same_host="no route given"))
        old = self._routes.get(peer_id)
        if old is not None and old != name:
            self.detach_peer(peer_id)
        if name == "nixl":
            self._backends["nixl"].attach_peer(peer_id, descriptors, route.nixl_metadata)
        else:
            self.shm.attach_peer(peer_id, descriptors)
        if self._routes.get(peer_id) != name:
            self._attached.append(name)
        self._routes[peer_id] = name

    def take_attached(self) -> list[str]:
        """The backend ("shm" or "nixl") of every peer attached since the last call (for metrics)."""
        attached, self._attached = self._attached, []
        return attached

    def transport_of(self, peer_id: str) -> str | None:
        """"shm" or "nixl" for an attached peer, None for an unknown one."""
        return self._routes.get(peer_id)

    def detach_peer(self, peer_id: str) -> None:
        name = self._routes.pop(peer_id, None)
        if name is not None:
            self._backends[name].detach_peer(peer_id)

    def submit(
        self, peer_id: str, direction: Direction, batch: Sequence[RegionOps], *, not_after: float | None = None
    ) -> TransferHandle:
        name = self._routes.get(peer_id)
        if name is None:
            handle = TransferHandle(peer_id, direction, sum(op.length for r in batch for op in r.ops), not_after)
            handle.finish(TransferStatus.FAILED, f"peer {peer_id!r} is not attached")
            return handle
        return self._backends[name].submit(peer_id, direction, batch, not_after=not_after)

    def cancel(self, handle: TransferHandle) -> bool:
        name = self._routes.get(handle.peer_id)
        return self._backends[name].cancel(handle) if name is not None else handle.cancel()

    def close(self) -> None:
        self._routes.clear()
        for backend in self._backends.values():
            backend.close()


def build_transport(policy: str, shm: Transport, agent_name: str, copy_timeout_s: float) -> RoutedTransport:
    """The worker's transport for `policy`: NIXL is started unless the policy is shm; a missing
    NIXL package is a ConfigError under policy nixl and leaves `auto` with shared memory only."""
    nixl = None
    if policy != "shm":
        from pdserve.transport.nixl import NixlTransport
        try:
            nixl = NixlTransport(agent_name, copy_timeout_s=copy_timeout_s)
        except ConfigError:
            if policy == "nixl":
                raise
            logger.warning("pdserve: transport auto without NIXL (pip install 'pdserve[nixl]'): "
                           "only peers on this host can be reached")
    return RoutedTransport(policy, shm, nixl)
