"""The base of the transports whose batches run on one background copy thread (shm, NIXL).

`submit` queues a batch and returns its handle at once. The copy thread takes queued batches in
order; it cancels one that reaches it after `close` or after its `not_after` deadline, skips one
cancelled while queued, and hands every other to the backend's `_copy` (after the stall hook, if
one is set, and a second look at the deadline: a batch is never handed on past `not_after`).
The backend bounds the rest: no byte of a batch may land after its `not_after`. Between queue waits it
calls `_progress` (a backend with copies in flight polls them there; `_poll_interval` says how
long the thread may wait for a new batch meanwhile). `close` stops the thread, cancels what is
still queued, then lets the backend release its peers and memory (`_close_backend`).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from abc import abstractmethod
from collections.abc import Callable, Sequence
from typing import NamedTuple, Protocol

from pdserve.transport.base import Direction, RegionDescriptor, RegionOps, TransferHandle, TransferStatus, Transport
from pdserve.transport.device import CPU, MemoryDevice

logger = logging.getLogger(__name__)

JOIN_DEADLINE_S = 5.0


class Job(NamedTuple):
    handle: TransferHandle
    batch: tuple[RegionOps, ...]
    ready: object = None  # device backends: an event the copy must wait for (recorded at submit)


# One checked copy of a batch: (local address, remote address, length in bytes); the remote address
# is in the peer's address space or mapped into ours, as the backend resolved the region. A plain
# tuple: a batch holds up to thousands, built on the copy thread, and a NamedTuple doubles that cost.
Copy = tuple[int, int, int]


# Called on the copy thread when a batch was admitted, before any of its bytes move (test rigs:
# a copy that began before its deadline and is slowed past it).
StallHook = Callable[[Direction], None]


def past(deadline: float | None) -> bool:
    """Whether the time.monotonic() deadline `deadline` (None: none) has passed."""
    return deadline is not None and time.monotonic() > deadline


class Region(Protocol):
    address: int
    size: int


class CopyThreadTransport(Transport):
    """A Transport with one copy thread (module docstring). A backend sets its own state, then
    calls `_start_copy_thread()` last in its `__init__`."""

    def __init__(self, name: str):
        self.name = name
        self._local: dict[int, RegionDescriptor] = {}
        self._jobs: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self._closed = False
        self._stall_hook: StallHook | None = None
        self._thread = threading.Thread(target=self._run, name=f"pdserve-{name}-copy", daemon=True)

    def _start_copy_thread(self) -> None:
        self._thread.start()

    # ---- backend hooks -----------------------------------------------------------------------

    def _register_memory(self, address: int, size: int, device: MemoryDevice) -> None:
        """Make a new local region reachable by the backend (before it is recorded); TransferError
        when the backend cannot reach memory on `device`."""

    @abstractmethod
    def _copy(self, job: Job) -> None:
        """On the copy thread: run an admitted batch (its handle has begun) and finish its handle,
        now or from a later `_progress`."""

    def _mark_ready(self) -> object:
        """On the submitting thread, at submit: what the batch's copy must wait for (a device
        backend records an event on the compute stream); None for host memory."""
        return None

    def _progress(self) -> None:
        """On the copy thread, whenever the queue is empty: advance copies still in flight."""

    def _poll_interval(self) -> float | None:
        """How long the copy thread may wait for a new batch before `_progress` (None: forever)."""
        return None

    @abstractmethod
    def _close_backend(self) -> None:
        """After the copy thread stopped and the queue was cancelled: release peers and memory."""

    # ---- regions and transfers (worker thread) -------------------------------------------------

    def register_region(
        self, region_id: int, address: int, size: int, shm_name: str | None = None, *, device: MemoryDevice = CPU
    ) -> RegionDescriptor:
        if region_id in self._local:
            raise ValueError(f"region {region_id} is already registered")
        if size <= 0 or address <= 0:
            raise ValueError(f"region {region_id}: bad address {address:#x} or size {size}")
        self._register_memory(address, size, device)
        desc = RegionDescriptor(region_id, size, shm_name, address, device)
        self._local[region_id] = desc
        return desc

    def set_stall_hook(self, hook: StallHook | None) -> None:
        """Install a hook run on the copy thread after a batch is admitted, before its bytes move
        (test-only; see pdserve/faults)."""
        self._stall_hook = hook

    def local_descriptors(self) -> list[RegionDescriptor]:
        return [self._local[i] for i in sorted(self._local)]

    def submit(
        self, peer_id: str, direction: Direction, batch: Sequence[RegionOps], *, not_after: float | None = None
    ) -> TransferHandle:
        batch = tuple(batch)
        num_bytes = sum(op.length for region_ops in batch for op in region_ops.ops)
        handle = TransferHandle(peer_id, direction, num_bytes, not_after)
        if self._closed:
            handle.finish(TransferStatus.FAILED, f"transport {self.name} is closed")
            return handle
        self._jobs.put(Job(handle, batch, self._mark_ready()))
        return handle

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._jobs.put(None)
        if self._thread.is_alive():
            self._thread.join(JOIN_DEADLINE_S)
            if self._thread.is_alive():
                logger.error("copy thread of transport %s did not stop within %.0f s", self.name, JOIN_DEADLINE_S)
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job.handle.cancel(f"transport {self.name} closed before the transfer ran")
        self._close_backend()

    # ---- copy thread ---------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            try:
                job = self._jobs.get(timeout=self._poll_interval())
            except queue.Empty:
                job = False
            while job is not False:
                if job is None:
                    return
                if self._admit(job.handle):
                    self._begin(job)
                try:
                    job = self._jobs.get_nowait()
                except queue.Empty:
                    job = False
            self._progress()

    def _begin(self, job: Job) -> None:
        """Run an admitted batch: the stall hook, then the backend's copy unless the deadline passed."""
        hook = self._stall_hook
        if hook is not None:
            try:
                hook(job.handle.direction)
            except Exception as exc:  # noqa: BLE001 - a failing hook fails the batch, not the thread
                job.handle.finish(TransferStatus.FAILED, f"copy failed: {type(exc).__name__}: {exc}")
                return
        if past(job.handle.not_after):
            job.handle.finish(TransferStatus.FAILED, "deadline passed before the copy started")
            return
        self._copy(job)

    def _admit(self, handle: TransferHandle) -> bool:
        """Begin `handle`, or cancel it when the transport closed or its deadline passed."""
        if self._closed:
            handle.cancel(f"transport {self.name} closed before the transfer ran")
            return False
        if past(handle.not_after):
            handle.cancel("deadline passed before the copy started")
            return False
        return handle.begin()  # False: cancelled while queued

    def _resolve(self, job: Job, remote_region: Callable[[int], Region | None]) -> list[Copy] | str:
        """Every copy of the batch as addresses, after checking them all; or an error message
        naming the first unknown region or out-of-bounds copy."""
        copies: list[Copy] = []
        for region_ops in job.batch:
            local = self._local.get(region_ops.region_id)
            if local is None:
                return f"no local region {region_ops.region_id}"
            remote = remote_region(region_ops.region_id)
            if remote is None:
                return f"peer {job.handle.peer_id!r} has no region {region_ops.region_id}"
            for op in region_ops.ops:
                if (op.length < 0 or op.local_offset < 0 or op.remote_offset < 0
                        or op.local_offset + op.length > local.size or op.remote_offset + op.length > remote.size):
                    return (f"region {region_ops.region_id}: copy local_offset={op.local_offset} "
                            f"remote_offset={op.remote_offset} length={op.length} is out of bounds "
                            f"(local size {local.size}, remote size {remote.size})")
                copies.append((local.address + op.local_offset, remote.address + op.remote_offset, op.length))
        return copies
