"""Transport on a NIXL agent (UCX): one-sided READ and WRITE into a peer's registered memory.

Works within a host (UCX picks CMA, one kernel copy) and across hosts (TCP, or RDMA where the
hardware has it). Each batch becomes one NIXL request holding every copy of the batch (the
connector merged neighbouring blocks already). The copy thread (copy_thread.py) posts queued
batches, polls the requests in flight and finishes their handles.

A posted request cannot be stopped: releasing it (NIXL's abort) cancels nothing of an RMA put or
get, whose bytes go on landing (measured over UCX TCP, 256 MiB: up to 0.41 s after the release),
and invalidating the peer's agent does not stop them either. So a handle fails only once its
request *ended* (NIXL reports it complete or failed; a broken endpoint fails it). A request still
running at its batch's `not_after` deadline, after `copy_timeout_s`, or whose peer is detached
or the transport closed, is *overdue*: it is polled on, not released, its handle stays PENDING
("still copying", transport/base.py) and fails when the request ends. An overdue request gets a
bounded drain (`write_drain_s`, `read_drain_s`); one still running after it cannot be known to
end, so `on_stuck_copy` is called, which by default ends this process (a process that is gone
posts no more bytes and its memory is never reused). A WRITE's drain must end before the peer's
fence (release_grace + margin after the deadline, 2.25 s by default; write_recv.py).

A peer is attached with its region descriptors plus its agent metadata (`local_endpoint()` on the
other side), which travels in the authenticated handshake; a detached peer's agent is forgotten
once its last request ended. Regions in host memory register as DRAM, regions on a GPU as VRAM
under the GPU's ordinal (`nixl_memory`), for UCX's CUDA transports; a peer's region is posted as
its descriptor's device says. One batch reads or writes one memory type on each side (a KV cache
lives on one device).
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
WRITE_DRAIN_S = 1.0  # an overdue WRITE must end within this, well inside the peer's fence (2.25 s by default)
READ_DRAIN_S = 30.0  # an overdue READ fills only our own blocks, held meanwhile
CLOSE_DRAIN_S = 2.0  # close waits this long at most for requests still running
POLL_INTERVAL_S = 0.0005


def exit_process(reason: str) -> None:
    """The default `on_stuck_copy`: log, then end this process at once."""
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
    """A posted request, never released before it ended."""

    handle: TransferHandle
    request: int
    posted: float  # perf_counter
    agent_name: str
    overdue: str | None = None  # why its handle will fail once it ended; None while it may still succeed
    drain_until: float = 0.0  # overdue: the monotonic time after which it counts as stuck
    stuck: bool = False  # `on_stuck_copy` was called for it
    landed: tuple[tuple[int, int], ...] = ()  # a READ into host memory: the (address, length) ranges it writes here


class NixlTransport(CopyThreadTransport):
    """See the module docstring. `agent_name` must be unique among the agents that meet: it is the
    instance's incarnation identity, and a peer is attached only with metadata of the agent named
    like its peer id."""

    def __init__(self, agent_name: str, *, name: str = "nixl", copy_timeout_s: float = COPY_TIMEOUT_S,
                 poll_interval_s: float = POLL_INTERVAL_S, agent: NixlAgent | None = None,
                 write_drain_s: float = WRITE_DRAIN_S, read_drain_s: float = READ_DRAIN_S,
                 on_stuck_copy: Callable[[str], None] = exit_process):
        super().__init__(name)
        self._agent = agent or NixlAgent(agent_name)
        self._copy_timeout_s = copy_timeout_s
        self._poll_interval_s = poll_interval_s
        self._drain_s = {Direction.WRITE: write_drain_s, Direction.READ: read_drain_s}
        self._on_stuck_copy = on_stuck_copy
        self._peers: dict[str, _Peer] = {}
        self._in_flight: list[_InFlight] = []
        self._retired: set[str] = set()  # detached peers' agents, forgotten once no request of theirs runs
        self._lock = threading.Lock()  # peers and in-flight requests: the worker thread detaches, the copy thread posts
        self._copy_hook: Callable[[Direction, list[tuple[int, int]]], None] | None = None
        self._start_copy_thread()

    def set_copy_hook(self, hook: Callable[[Direction, list[tuple[int, int]]], None] | None) -> None:
        """Install a hook run on the copy thread after a READ into host memory landed, before its
        handle turns DONE, with the (address, length) ranges it wrote here; a hook that raises
        fails the batch. A WRITE lands in the peer's memory, out of this process's reach: no hook.
        Test-only (pdserve/faults), as ShmTransport's."""
        self._copy_hook = hook

    # ---- regions and peers (worker thread) ---------------------------------------------------

    def _register_memory(self, address: int, size: int, device: MemoryDevice) -> None:
        self._agent.register(address, size, nixl_memory(device))

    def local_endpoint(self) -> bytes:
        """This agent's metadata (its UCX addresses and registered memory keys), for the handshake."""
        return self._agent.metadata()

    def attach_peer(self, peer_id: str, descriptors: list[RegionDescriptor], endpoint: bytes | None = None) -> None:
        """Load the peer's agent metadata (`endpoint`); TransferError when it is missing or NIXL
        rejects it, a region has no address, or requests to an earlier attachment of this peer
        still run (see Transport.attach_peer)."""
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
        if peer_id in self._retired:
            problems.append("copies of its earlier attachment are still running")
        if problems:
            raise TransferError(f"peer {peer_id!r}: cannot reach its regions over NIXL: " + "; ".join(problems))
        try:
            agent_name = self._agent.add_remote(endpoint)
        except TransferError as exc:
            raise TransferError(f"peer {peer_id!r}: {exc}") from None
        if agent_name != peer_id:  # the metadata must be the incarnation's own, not another agent's
            if not any(p.agent_name == agent_name for p in self._peers.values()) and agent_name not in self._retired:
                self._agent.remove_remote(agent_name)
            raise TransferError(f"peer {peer_id!r} sent the NIXL metadata of agent {agent_name!r}")
        with self._lock:
            self._peers[peer_id] = _Peer(agent_name, endpoint, wanted)

    def detach_peer(self, peer_id: str) -> None:
        """Forget the peer: its requests still running become overdue (their handles fail once
        they ended), and its agent is forgotten after the last of them."""
        with self._lock:
            peer = self._peers.pop(peer_id, None)
            if peer is None:
                return
            self._in_flight = [self._make_overdue(f, f"peer {peer_id!r} was detached during the transfer")
                               if f.handle.peer_id == peer_id else f for f in self._in_flight]
            self._retired.add(peer.agent_name)
            self._forget_retired()

    def _close_backend(self) -> None:
        with self._lock:
            self._in_flight = [self._make_overdue(f, f"transport {self.name} closed during the transfer")
                               for f in self._in_flight]
        deadline = time.monotonic() + CLOSE_DRAIN_S
        while self._in_flight and time.monotonic() < deadline:
            time.sleep(self._poll_interval_s)
            self._progress()
        for peer_id in list(self._peers):
            self.detach_peer(peer_id)
        if self._in_flight:  # their handles stay PENDING: nobody may reuse what they may still write
            logger.error("transport %s: %d NIXL requests still running at close; memory stays registered",
                         self.name, len(self._in_flight))
            return
        try:
            self._agent.close()
        except TransferError as exc:
            logger.warning("transport %s: %s", self.name, exc)

    # ---- copy thread ----------------------------------------------------------------------------

    def _poll_interval(self) -> float | None:
        return self._poll_interval_s if self._in_flight else None

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
            except TransferError as exc:  # post releases a request it could not post
                handle.finish(TransferStatus.FAILED, str(exc))
                return
            landed = tuple((local, length) for local, length, _ in local_list) \
                if handle.direction is Direction.READ and local_memory == DRAM else ()
            self._settle(_InFlight(handle, request, posted, peer.agent_name, landed=landed), state, None)

    def _memories(self, job: Job, peer: _Peer) -> tuple[NixlMemory, NixlMemory] | str:
        """The one NIXL memory of each side of a checked batch, or why the batch mixes several."""
        local = {nixl_memory(self._local[r.region_id].device) for r in job.batch if r.ops}
        remote = {nixl_memory(peer.region(r.region_id).device) for r in job.batch if r.ops}
        if len(local) > 1 or len(remote) > 1:
            return (f"a batch spans several memories (local {sorted(local)}, remote {sorted(remote)}); "
                    "NIXL posts one memory type per side")
        return (local.pop() if local else DRAM, remote.pop() if remote else DRAM)

    def _progress(self) -> None:
        if not self._in_flight:
            return
        with self._lock:
            flights, self._in_flight = self._in_flight, []
            for flight in flights:
                try:
                    state, error = self._agent.state(flight.request), None
                except TransferError as exc:  # NIXL reports the request ended in error (a broken endpoint)
                    state, error = XferState.FAILED, str(exc)
                self._settle(flight, state, error)
            self._forget_retired()

    def _settle(self, flight: _InFlight, state: XferState, error: str | None) -> None:
        """Finish `flight` if its request ended, else keep it (overdue once past its deadline).
        Called with the lock held, `flight` not in the in-flight list."""
        if state is XferState.DONE:
            error = flight.overdue or self._run_copy_hook(flight)
            self._end(flight, TransferStatus.FAILED if error else TransferStatus.DONE, error)
            return
        if state is XferState.FAILED:
            self._end(flight, TransferStatus.FAILED,
                      flight.overdue or error or f"NIXL transfer to peer {flight.handle.peer_id!r} failed")
            return
        if flight.overdue is None and past(flight.handle.not_after):
            flight = self._make_overdue(flight, "deadline passed during the copy")
        elif flight.overdue is None and time.perf_counter() - flight.posted > self._copy_timeout_s:
            flight = self._make_overdue(flight, f"NIXL transfer not complete after {self._copy_timeout_s:.1f} s")
        elif flight.overdue is not None and not flight.stuck and past(flight.drain_until):
            flight = flight._replace(stuck=True)
            reason = (f"a NIXL {flight.handle.direction.name} with {flight.handle.peer_id!r} ({flight.overdue}) "
                      f"still runs {self._drain_s[flight.handle.direction]:.1f} s later")
            logger.error("transport %s: %s; it counts as still copying", self.name, reason)
            self._on_stuck_copy(reason)
        self._in_flight.append(flight)

    def _run_copy_hook(self, flight: _InFlight) -> str | None:
        hook = self._copy_hook
        if hook is None or not flight.landed:
            return None
        try:
            hook(flight.handle.direction, list(flight.landed))
        except Exception as exc:  # noqa: BLE001 - a failing hook fails the batch, not the copy thread
            return f"copy failed: {type(exc).__name__}: {exc}"
        return None

    def _make_overdue(self, flight: _InFlight, reason: str) -> _InFlight:
        if flight.overdue is not None:
            return flight
        logger.debug("transport %s: %s; waiting for the NIXL request to end", self.name, reason)
        return flight._replace(overdue=reason, drain_until=time.monotonic() + self._drain_s[flight.handle.direction])

    def _end(self, flight: _InFlight, status: TransferStatus, error: str | None) -> None:
        """A request NIXL reported complete or failed: nothing of it moves any more."""
        try:
            self._agent.release(flight.request)
        except TransferError as exc:
            logger.warning("transport %s: %s", self.name, exc)
        flight.handle.copy_seconds = time.perf_counter() - flight.posted
        if status is TransferStatus.FAILED:
            logger.debug("transfer to %s failed: %s", flight.handle.peer_id, error)
        flight.handle.finish(status, error)

    def _forget_retired(self) -> None:
        """Forget the agents of detached peers no request runs with any more (lock held)."""
        busy = {f.agent_name for f in self._in_flight} | {p.agent_name for p in self._peers.values()}
        for agent_name in self._retired - busy:
            self._retired.discard(agent_name)
            try:
                self._agent.remove_remote(agent_name)
            except TransferError as exc:
                logger.warning("transport %s: %s", self.name, exc)
