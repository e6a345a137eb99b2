"""Transport on a NIXL agent (UCX): one-sided READ and WRITE into a peer's registered memory.

Works within a host (UCX picks CMA, one kernel copy) and across hosts (TCP, or RDMA where the
hardware has it). Each batch becomes one NIXL request holding every copy of the batch (the
connector merged neighbouring blocks already). The copy thread (copy_thread.py) posts queued
batches, polls the requests in flight and finishes their handles; a request not complete by its
batch's `not_after` deadline or after `copy_timeout_s` is aborted and failed, as is every request
to a peer that is detached or whose agent died (UCX reports the broken endpoint).

Aborting is releasing the request (NIXL aborts it first). Its handle fails only once the release
succeeded: a request NIXL could not release may still be moving bytes, so its handle stays
PENDING ("still copying") and the release is retried at every poll. For a WRITE that is memory
of the peer's, which the peer will reuse once its own fence passed; nothing here can stop the
bytes any more, so `on_stuck_write` is called, and by default it ends this process (a process
that is gone posts no more bytes, and its agent's endpoints close with it).

A peer is attached with its region descriptors plus its agent metadata (`local_endpoint()` on the
other side), which travels in the authenticated handshake. Regions in host memory register as
DRAM, regions on a GPU as VRAM under the GPU's ordinal (`nixl_memory`), for UCX's CUDA transports;
a peer's region is posted as its descriptor's device says. One batch reads or writes one memory
type on each side (a KV cache lives on one device).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import NamedTuple

from pdserve.errors import TransferError
from pdserve.transport.base import Direction, RegionDescriptor, TransferHandle, TransferStatus
from pdserve.transport.copy_thread import CopyThreadTransport, Job, past
from pdserve.transport.device import MemoryDevice
from pdserve.transport.nixl_agent import DRAM, NixlAgent, NixlMemory, XferState, nixl_memory

logger = logging.getLogger(__name__)

COPY_TIMEOUT_S = 30.0
POLL_INTERVAL_S = 0.0005


def exit_process(reason: str) -> None:
    """The default `on_stuck_write`: log, then end this process at once."""
    logger.critical("pdserve: %s; ending this process so that no byte of it can land late", reason)
    logging.shutdown()
    os._exit(70)


class _Peer(NamedTuple):
    agent_name: str
    metadata: bytes
    descriptors: tuple[RegionDescriptor, ...]

    def region(self, region_id: int) -> RegionDescriptor | None:
        return next((d for d in self.descriptors if d.region_id == region_id), None)


class _InFlight(NamedTuple):
    handle: TransferHandle
    request: int
    posted: float


class NixlTransport(CopyThreadTransport):
    """See the module docstring. `agent_name` must be unique among the agents that meet: it is the
    instance's incarnation identity, and a peer is attached only with metadata of the agent named
    like its peer id."""

    def __init__(self, agent_name: str, *, name: str = "nixl", copy_timeout_s: float = COPY_TIMEOUT_S,
                 poll_interval_s: float = POLL_INTERVAL_S, agent: NixlAgent | None = None,
                 on_stuck_write: Callable[[str], None] = exit_process):
        super().__init__(name)
        self._agent = agent or NixlAgent(agent_name)
        self._copy_timeout_s = copy_timeout_s
        self._poll_interval_s = poll_interval_s
        self._on_stuck_write = on_stuck_write
        self._peers: dict[str, _Peer] = {}
        self._in_flight: list[_InFlight] = []
        self._stuck: list[tuple[_InFlight, str]] = []  # aborted, release failed: may still be copying
        self._lock = threading.Lock()  # peers and in-flight requests: the worker thread detaches, the copy thread posts
        self._start_copy_thread()

    # ---- regions and peers (worker thread) ---------------------------------------------------

    def _register_memory(self, address: int, size: int, device: MemoryDevice) -> None:
        self._agent.register(address, size, nixl_memory(device))

    def local_endpoint(self) -> bytes:
        """This agent's metadata (its UCX addresses and registered memory keys), for the handshake."""
        return self._agent.metadata()

    def attach_peer(self, peer_id: str, descriptors: list[RegionDescriptor], endpoint: bytes | None = None) -> None:
        """Load the peer's agent metadata (`endpoint`); TransferError when it is missing or NIXL
        rejects it, or a region has no address (see Transport.attach_peer)."""
        wanted = tuple(sorted(descriptors, key=lambda d: d.region_id))
        current = self._peers.get(peer_id)
        if current is not None and current.descriptors == wanted and current.metadata == endpoint:
            return
        self.detach_peer(peer_id)
        problems = [f"region {d.region_id} has no address" for d in wanted if d.address is None]
        if len({d.region_id for d in wanted}) != len(wanted):
            problems.append("a region is described more than once")
        if not endpoint:
            problems.append("no NIXL agent metadata in the handshake")
        if problems:
            raise TransferError(f"peer {peer_id!r}: cannot reach its regions over NIXL: " + "; ".join(problems))
        try:
            agent_name = self._agent.add_remote(endpoint)
        except TransferError as exc:
            raise TransferError(f"peer {peer_id!r}: {exc}") from None
        if agent_name != peer_id:  # the metadata must be the incarnation's own, not another agent's
            if not any(p.agent_name == agent_name for p in self._peers.values()):
                self._agent.remove_remote(agent_name)
            raise TransferError(f"peer {peer_id!r} sent the NIXL metadata of agent {agent_name!r}")
        with self._lock:
            self._peers[peer_id] = _Peer(agent_name, endpoint, wanted)

    def detach_peer(self, peer_id: str) -> None:
        """Forget the peer: its requests in flight are aborted and failed first."""
        with self._lock:
            peer = self._peers.pop(peer_id, None)
            if peer is None:
                return
            for flight in [f for f in self._in_flight if f.handle.peer_id == peer_id]:
                self._in_flight.remove(flight)
                self._abort(flight, f"peer {peer_id!r} was detached during the transfer")
            if not any(p.agent_name == peer.agent_name for p in self._peers.values()):
                try:
                    self._agent.remove_remote(peer.agent_name)
                except TransferError as exc:
                    logger.warning("transport %s: %s", self.name, exc)

    def _close_backend(self) -> None:
        with self._lock:
            flights, self._in_flight = self._in_flight, []
            for flight in flights:
                self._abort(flight, f"transport {self.name} closed during the transfer")
            self._retry_stuck()
        for peer_id in list(self._peers):
            self.detach_peer(peer_id)
        try:
            self._agent.close()
        except TransferError as exc:
            logger.warning("transport %s: %s", self.name, exc)

    # ---- copy thread ----------------------------------------------------------------------------

    def _poll_interval(self) -> float | None:
        return self._poll_interval_s if self._in_flight or self._stuck else None

    def _copy(self, job: Job) -> None:
        handle = job.handle
        with self._lock:
            peer = self._peers.get(handle.peer_id)
            if peer is None:
                handle.finish(TransferStatus.FAILED, f"peer {handle.peer_id!r} is not attached")
                return
            copies = self._resolve(job, peer.region)
            if isinstance(copies, str):
                handle.finish(TransferStatus.FAILED, copies)
                return
            memories = self._memories(job, peer)
            if isinstance(memories, str):
                handle.finish(TransferStatus.FAILED, memories)
                return
            local_memory, remote_memory = memories
            local_list = [(local, length, local_memory.device_id) for local, _, length in copies if length]
            if not local_list:
                handle.copy_seconds = 0.0
                handle.finish(TransferStatus.DONE)
                return
            remote_list = [(remote, length, remote_memory.device_id) for _, remote, length in copies if length]
            posted = time.perf_counter()
            try:
                request, state = self._agent.post(handle.direction is Direction.WRITE, local_list, remote_list,
                                                  peer.agent_name, local_memory.segment, remote_memory.segment)
            except TransferError as exc:
                handle.finish(TransferStatus.FAILED, str(exc))
                return
            self._settle(_InFlight(handle, request, posted), state)

    def _memories(self, job: Job, peer: _Peer) -> tuple[NixlMemory, NixlMemory] | str:
        """The one NIXL memory of each side of a checked batch, or why the batch mixes several."""
        local = {nixl_memory(self._local[r.region_id].device) for r in job.batch if r.ops}
        remote = {nixl_memory(peer.region(r.region_id).device) for r in job.batch if r.ops}
        if len(local) > 1 or len(remote) > 1:
            return (f"a batch spans several memories (local {sorted(local)}, remote {sorted(remote)}); "
                    "NIXL posts one memory type per side")
        return (local.pop() if local else DRAM, remote.pop() if remote else DRAM)

    def _progress(self) -> None:
        if not self._in_flight and not self._stuck:
            return
        with self._lock:
            self._retry_stuck()
            for flight in list(self._in_flight):
                try:
                    state = self._agent.state(flight.request)
                except TransferError as exc:
                    self._in_flight.remove(flight)
                    self._abort(flight, str(exc))
                    continue
                self._in_flight.remove(flight)
                self._settle(flight, state)

    def _settle(self, flight: _InFlight, state: XferState) -> None:
        """Called with the lock held, `flight` not in the in-flight list."""
        if state is XferState.DONE:
            self._end(flight, TransferStatus.DONE)
        elif state is XferState.FAILED:
            self._end(flight, TransferStatus.FAILED, f"NIXL transfer to peer {flight.handle.peer_id!r} failed")
        elif past(flight.handle.not_after):
            self._abort(flight, "deadline passed during the copy (NIXL transfer aborted)")
        elif time.perf_counter() - flight.posted > self._copy_timeout_s:
            self._abort(flight, f"NIXL transfer not complete after {self._copy_timeout_s:.1f} s")
        else:
            self._in_flight.append(flight)

    def _abort(self, flight: _InFlight, error: str) -> None:
        """Release a request that is not complete; its handle fails only when NIXL confirmed it.
        Called with the lock held, `flight` not in the in-flight list."""
        try:
            self._agent.release(flight.request)
        except TransferError as exc:
            self._stuck.append((flight, error))
            reason = f"NIXL could not abort a transfer to {flight.handle.peer_id!r} ({error}): {exc}"
            logger.error("transport %s: %s; it counts as still copying", self.name, reason)
            if flight.handle.direction is Direction.WRITE:
                self._on_stuck_write(reason)
            return
        self._finish(flight, TransferStatus.FAILED, error)

    def _retry_stuck(self) -> None:
        """Release again what could not be released; a READ's handle fails once that worked."""
        stuck, self._stuck = self._stuck, []
        for flight, error in stuck:
            try:
                self._agent.release(flight.request)
            except TransferError:
                self._stuck.append((flight, error))
                continue
            self._finish(flight, TransferStatus.FAILED, error)

    def _end(self, flight: _InFlight, status: TransferStatus, error: str | None = None) -> None:
        """A request NIXL reported complete or failed: nothing of it moves any more."""
        try:
            self._agent.release(flight.request)
        except TransferError as exc:
            logger.warning("transport %s: %s", self.name, exc)
        self._finish(flight, status, error)

    def _finish(self, flight: _InFlight, status: TransferStatus, error: str | None = None) -> None:
        flight.handle.copy_seconds = time.perf_counter() - flight.posted
        if status is TransferStatus.FAILED:
            logger.debug("transfer to %s failed: %s", flight.handle.peer_id, error)
        flight.handle.finish(status, error)
