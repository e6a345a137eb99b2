"""Per-peer choice of transport: shared memory for a peer proven on this host, NIXL otherwise.

The connector's `transport` key picks the policy: `shm` (every peer over shared memory, as before),
`nixl` (every peer over NIXL, same host included) or `auto` (shared memory when the handshake's host
proof holds, see nixl_host.py; NIXL otherwise). Both backends see the same KV memory: it lives in
shm segments (mapped by same-host peers) and is registered with the NIXL agent as DRAM. Each peer
incarnation is attached to exactly one backend, and its transfers go there.

With the KV cache on a GPU (device_transport.py builds it), the same-host backend is gpu-ipc
instead of shm (`local_name`), device storages are registered with `register_tensor`, and NIXL
registers them as VRAM; policy `gpu-ipc` sends every peer to gpu-ipc, and only peers that proved
to share our host (IPC handles open nowhere else).

Under `auto` the NIXL agent starts only when the first peer that is not on this host needs it:
either side of a handshake proves its host to the other, so a replier starts it for a requester
that proved nothing, and a requester for a replier that did not. An agent costs every step even
with no NIXL peer: its UCX progress thread wakes every PROGRESS_DELAY_US, and on a one-core
instance that made each decode step ~10 % slower (2.5-3.5 ms of ~26 ms on an Intel Xeon; the
same instance with transport shm was within 0.5 ms of plain vLLM, `benchmarks/step-overhead/`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import NamedTuple

from pdserve.errors import ConfigError, TransferError
from pdserve.transport.base import Direction, RegionDescriptor, RegionOps, TransferHandle, TransferStatus, Transport
from pdserve.transport.device import CPU, MemoryDevice
from pdserve.transport.nixl import NixlTransport
from pdserve.transport.nixl_agent import NIXL_PACKAGE, nixl_installed

logger = logging.getLogger(__name__)

POLICIES = ("auto", "shm", "nixl", "gpu-ipc")
LOCAL_ONLY = ("shm", "gpu-ipc")  # policies that never use NIXL


class _Registered(NamedTuple):
    region_id: int
    address: int
    size: int
    shm_name: str | None
    device: MemoryDevice

    def register_with(self, transport: Transport) -> RegionDescriptor:
        """Register with `transport`, naming the device only when it is not the CPU (so backends
        and wrappers of host memory are called exactly as before)."""
        if self.device.is_cpu:
            return transport.register_region(self.region_id, self.address, self.size, self.shm_name)
        return transport.register_region(self.region_id, self.address, self.size, self.shm_name, device=self.device)


class PeerRoute(NamedTuple):
    """What the handshake learnt about reaching a peer: whether it proved to share our host (and
    why not), and its NIXL agent metadata (empty when it has none)."""

    same_host: bool
    nixl_metadata: bytes = b""
    why_not_same_host: str = ""


class RoutedTransport(Transport):
    """Called like any Transport, except that `attach_peer` takes the peer's route. NIXL is either
    running (`nixl`), started on first need (`start_nixl`, policy auto), or unavailable (neither:
    NIXL is not installed, or policy shm or gpu-ipc). `shm` is the same-host backend, named
    `local_name` in routes (ShmTransport, or GpuIpcTransport for device memory)."""

    def __init__(self, policy: str, shm: Transport, nixl: Transport | None = None,
                 start_nixl: Callable[[], Transport] | None = None, local_name: str = "shm"):
        if policy not in POLICIES:
            raise ConfigError(f"unknown transport {policy!r} (available: {', '.join(POLICIES)})")
        if policy == "nixl" and nixl is None:
            raise ConfigError(f"transport nixl needs the {NIXL_PACKAGE} package: pip install 'pdserve[nixl]'")
        self.policy = policy
        self.shm = shm
        self.local_name = local_name
        self._nixl = nixl
        self._start_nixl = start_nixl if policy == "auto" else None
        self._lock = threading.Lock()  # starting NIXL: handshake threads on both sides may need it at once
        self._regions: list[_Registered] = []  # registered so far: a late agent gets them too
        self._routes: dict[str, str] = {}
        self._attached: list[str] = []  # the backend of each attach since `take_attached`

    @property
    def nixl_running(self) -> bool:
        return self._nixl is not None

    def register_region(
        self, region_id: int, address: int, size: int, shm_name: str | None = None, *, device: MemoryDevice = CPU
    ) -> RegionDescriptor:
        region = _Registered(region_id, address, size, shm_name, device)
        desc = region.register_with(self.shm)
        self._register_with_nixl(region)
        return desc

    def register_tensor(self, region_id: int, tensor) -> RegionDescriptor:
        """Register a device storage with the same-host backend (gpu-ipc) and, where NIXL may
        run, with NIXL as VRAM."""
        register = getattr(self.shm, "register_tensor", None)
        if register is None:
            raise TransferError(f"transport {self.local_name} cannot share device memory")
        desc = register(region_id, tensor)
        self._register_with_nixl(_Registered(region_id, desc.address, desc.size, desc.shm_name, desc.device))
        return desc

    def _register_with_nixl(self, region: _Registered) -> None:
        with self._lock:
            self._regions.append(region)
            if self._nixl is not None and self.policy not in LOCAL_ONLY:
                region.register_with(self._nixl)

    def local_descriptors(self) -> list[RegionDescriptor]:
        return self.shm.local_descriptors()

    def local_endpoint(self, peer_here: bool = False) -> bytes:
        """Our NIXL agent metadata for a handshake reply to a peer (`peer_here`: it proved it shares
        our host): empty under policy shm, under auto for a peer here (it maps our memory), and
        where NIXL is unavailable or fails to start (the peer then says so); otherwise the agent's,
        started now under auto if this is the first peer that needs it."""
        if self.policy in LOCAL_ONLY or (self.policy == "auto" and peer_here):
            return b""
        try:
            nixl = self._nixl_backend("a peer that is not provably on this host asked for our KV layout")
        except TransferError as exc:
            logger.error("pdserve: cannot offer NIXL to a peer not on this host: %s", exc)
            return b""
        return nixl.local_endpoint()

    def choose(self, route: PeerRoute) -> str:
        """The backend a peer with `route` gets; TransferError when none can reach it."""
        if self.policy == "gpu-ipc" and not route.same_host:
            raise TransferError(f"transport gpu-ipc reaches peers on this host only, and the peer is not provably "
                                f"here ({route.why_not_same_host})")
        if self.policy in LOCAL_ONLY or (self.policy == "auto" and route.same_host):
            return self.local_name
        if self._nixl is None and self._start_nixl is None:
            raise TransferError(f"the peer is not provably on this host ({route.why_not_same_host}) and transport "
                                f"nixl is unavailable: pip install 'pdserve[nixl]'")
        if not route.nixl_metadata:
            raise TransferError("the peer offers no NIXL agent metadata (it runs without NIXL or with transport shm)")
        return "nixl"

    def attach_peer(self, peer_id: str, descriptors: list[RegionDescriptor], route: PeerRoute | None = None) -> None:
        route = route or PeerRoute(same_host=False, why_not_same_host="no route given")
        name = self.choose(route)
        old = self._routes.get(peer_id)
        if old is not None and old != name:
            self.detach_peer(peer_id)
        if name == "nixl":
            self._nixl_backend(f"peer {peer_id} is not provably on this host ({route.why_not_same_host})") \
                .attach_peer(peer_id, descriptors, route.nixl_metadata)
        else:
            self.shm.attach_peer(peer_id, descriptors)
        if self._routes.get(peer_id) != name:
            self._attached.append(name)
        self._routes[peer_id] = name

    def _nixl_backend(self, why: str) -> Transport:
        """NIXL, started now (with every region registered so far) if it is not running yet."""
        with self._lock:
            if self._nixl is None:
                if self._start_nixl is None:
                    raise TransferError("transport nixl is unavailable: pip install 'pdserve[nixl]'")
                try:
                    nixl = self._start_nixl()
                except (ConfigError, TransferError) as exc:
                    raise TransferError(f"NIXL did not start: {exc}") from exc
                try:
                    for region in self._regions:
                        region.register_with(nixl)
                except Exception:
                    nixl.close()
                    raise
                self._nixl = nixl
                logger.info("pdserve: NIXL started: %s", why)
            return self._nixl

    def _backend(self, name: str) -> Transport:
        return self._nixl if name == "nixl" else self.shm

    def take_attached(self) -> list[str]:
        """The backend ("shm", "gpu-ipc" or "nixl") of every peer attached since the last call (for metrics)."""
        attached, self._attached = self._attached, []
        return attached

    def transport_of(self, peer_id: str) -> str | None:
        """"shm", "gpu-ipc" or "nixl" for an attached peer, None for an unknown one."""
        return self._routes.get(peer_id)

    def detach_peer(self, peer_id: str) -> None:
        name = self._routes.pop(peer_id, None)
        if name is not None:
            self._backend(name).detach_peer(peer_id)

    def submit(
        self, peer_id: str, direction: Direction, batch: Sequence[RegionOps], *, not_after: float | None = None
    ) -> TransferHandle:
        name = self._routes.get(peer_id)
        if name is None:
            handle = TransferHandle(peer_id, direction, sum(op.length for r in batch for op in r.ops), not_after)
            handle.finish(TransferStatus.FAILED, f"peer {peer_id!r} is not attached")
            return handle
        return self._backend(name).submit(peer_id, direction, batch, not_after=not_after)

    def cancel(self, handle: TransferHandle) -> bool:
        name = self._routes.get(handle.peer_id)
        return self._backend(name).cancel(handle) if name is not None else handle.cancel()

    def close(self) -> None:
        self._routes.clear()
        self.shm.close()
        with self._lock:
            self._start_nixl = None  # closed: nothing starts NIXL any more
            if self._nixl is not None:
                self._nixl.close()


def build_transport(policy: str, shm: Transport, agent_name: str, copy_timeout_s: float,
                    prepare: Callable[[Transport], Transport] = lambda transport: transport,
                    local_name: str = "shm") -> RoutedTransport:
    """The worker's transport for `policy`: NIXL starts now under policy nixl (a ConfigError when
    it is not installed), on first need under auto (module docstring), never under shm or gpu-ipc.
    `prepare` sees the NIXL backend once when it starts (the worker's rig hooks in there).
    `shm` is the same-host backend, named `local_name` (device_transport.py passes gpu-ipc)."""
    if policy in LOCAL_ONLY:
        return RoutedTransport(policy, shm, local_name=local_name)

    def start_nixl() -> Transport:
        return prepare(NixlTransport(agent_name, copy_timeout_s=copy_timeout_s))

    if policy == "nixl":
        return RoutedTransport(policy, shm, start_nixl(), local_name=local_name)
    if not nixl_installed():
        logger.warning("pdserve: transport auto without NIXL (pip install 'pdserve[nixl]'): "
                       "only peers on this host can be reached")
        return RoutedTransport(policy, shm, local_name=local_name)
    return RoutedTransport(policy, shm, start_nixl=start_nixl, local_name=local_name)
