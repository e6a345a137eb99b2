"""Same-host transport: the peer's regions are POSIX shm segments we map; copies are memmoves.

No socket and no serialisation on the data path: one background thread runs each submitted batch
as a series of `ctypes.memmove` calls (which release the GIL) between our region and the mapped
peer region, then marks the batch's handle DONE or FAILED. Before each batch it skips a handle
that was cancelled and fails one whose `not_after` deadline has passed.
"""

from __future__ import annotations

import ctypes
import logging
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import NamedTuple

from pdserve.errors import TransferError
from pdserve.transport.base import (
    Direction,
    RegionDescriptor,
    RegionOps,
    Transport,
    TransferHandle,
    TransferStatus,
)
from pdserve.transport.shared_segment import SharedSegment

logger = logging.getLogger(__name__)

# Called on the copy thread after a batch's bytes landed, before its handle turns DONE, with the
# (address, length) ranges written in this process's address space. Test hooks only.
CopyHook = Callable[[Direction, list[tuple[int, int]]], None]

_JOIN_DEADLINE_S = 5.0


class _Region(NamedTuple):
    address: int
    size: int


class _Job(NamedTuple):
    handle: TransferHandle
    batch: tuple[RegionOps, ...]


class _PeerMapping:
    """A peer's regions as mapped here. Maps every segment or raises TransferError naming each
    region that could not be mapped (mapping nothing)."""

    def __init__(self, descriptors: tuple[RegionDescriptor, ...]):
        self.descriptors = descriptors
        self.segments: dict[int, SharedSegment] = {}
        errors = []
        region_ids = Counter(desc.region_id for desc in descriptors)
        for desc in descriptors:
            if region_ids[desc.region_id] > 1:
                errors.append(f"region {desc.region_id} is described more than once")
                continue
            if desc.shm_name is None:
                errors.append(f"region {desc.region_id} has no shm segment name")
                continue
            try:
                self.segments[desc.region_id] = SharedSegment.attach(desc.shm_name, desc.size)
            except TransferError as e:
                errors.append(f"region {desc.region_id}: {e}")
        if errors:
            self.close()
            raise TransferError("cannot map the peer's regions: " + "; ".join(errors))

    def region(self, region_id: int) -> _Region | None:
        segment = self.segments.get(region_id)
        return None if segment is None else _Region(segment.address, segment.size)

    def close(self) -> None:
        for segment in self.segments.values():
            segment.close(unlink=False)


class ShmTransport(Transport):
    """Transport between processes on one host through shm segments (see module docstring)."""

    def __init__(self, name: str = "shm"):
        self.name = name
        self._local: dict[int, RegionDescriptor] = {}
        self._peers: dict[str, _PeerMapping] = {}
        self._copy_hook: CopyHook | None = None
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._mapping_lock = threading.Lock()  # held while copying, so peers are never unmapped mid-copy
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=f"pdserve-{name}-copy", daemon=True)
        self._thread.start()

    def register_region(
        self, region_id: int, address: int, size: int, shm_name: str | None = None
    ) -> RegionDescriptor:
        if region_id in self._local:
            raise ValueError(f"region {region_id} is already registered")
        if size <= 0 or address <= 0:
            raise ValueError(f"region {region_id}: bad address {address:#x} or size {size}")
        desc = RegionDescriptor(region_id, size, shm_name, address)
        self._local[region_id] = desc
        return desc

    def local_descriptors(self) -> list[RegionDescriptor]:
        return [self._local[i] for i in sorted(self._local)]

    def attach_peer(self, peer_id: str, descriptors: list[RegionDescriptor]) -> None:
        """Map the peer's shm segments (see Transport.attach_peer)."""
        wanted = tuple(sorted(descriptors, key=lambda d: d.region_id))
        current = self._peers.get(peer_id)
        if current is not None and current.descriptors == wanted:
            return
        try:
            mapping = _PeerMapping(wanted)
        except TransferError as e:
            self.detach_peer(peer_id)
            raise TransferError(f"peer {peer_id!r}: {e}") from None
        with self._mapping_lock:
            old = self._peers.get(peer_id)
            self._peers[peer_id] = mapping
        if old is not None:
            old.close()

    def detach_peer(self, peer_id: str) -> None:
        with self._mapping_lock:
            mapping = self._peers.pop(peer_id, None)
        if mapping is not None:
            mapping.close()

    def set_copy_hook(self, hook: CopyHook | None) -> None:
        """Install a hook run after each successful batch (test-only; see CorruptingTransport)."""
        self._copy_hook = hook

    def submit(
        self, peer_id: str, direction: Direction, batch: Sequence[RegionOps], *, not_after: float | None = None
    ) -> TransferHandle:
        batch = tuple(batch)
        num_bytes = sum(op.length for region_ops in batch for op in region_ops.ops)
        handle = TransferHandle(peer_id, direction, num_bytes, not_after)
        if self._closed:
            handle.finish(TransferStatus.FAILED, f"transport {self.name} is closed")
            return handle
        self._jobs.put(_Job(handle, batch))
        return handle

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._jobs.put(None)
        self._thread.join(_JOIN_DEADLINE_S)
        if self._thread.is_alive():
            logger.error("copy thread of transport %s did not stop within %.0f s", self.name, _JOIN_DEADLINE_S)
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job.handle.cancel(f"transport {self.name} closed before the transfer ran")
        with self._mapping_lock:
            peers, self._peers = self._peers, {}
        for mapping in peers.values():
            mapping.close()

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            handle = job.handle
            if self._closed:
                handle.cancel(f"transport {self.name} closed before the transfer ran")
                continue
            if handle.not_after is not None and time.monotonic() > handle.not_after:
                handle.cancel("deadline passed before the copy started")
                continue
            if not handle.begin():
                continue  # cancelled while queued
            began = time.perf_counter()
            try:
                with self._mapping_lock:
                    error = self._execute(job)
            except Exception as e:  # noqa: BLE001 - a failure must reach the handle, not kill the thread
                error = f"copy failed: {type(e).__name__}: {e}"
            handle.copy_seconds = time.perf_counter() - began
            if error is None:
                handle.finish(TransferStatus.DONE)
            else:
                logger.debug("transfer to %s failed: %s", handle.peer_id, error)
                handle.finish(TransferStatus.FAILED, error)

    def _execute(self, job: _Job) -> str | None:
        """Check every op, then copy them all; returns an error message or None."""
        handle = job.handle
        mapping = self._peers.get(handle.peer_id)
        if mapping is None:
            return f"peer {handle.peer_id!r} is not attached"
        copies: list[tuple[int, int, int]] = []  # (dst, src, length)
        write = handle.direction is Direction.WRITE
        for region_ops in job.batch:
            local_desc = self._local.get(region_ops.region_id)
            if local_desc is None:
                return f"no local region {region_ops.region_id}"
            remote = mapping.region(region_ops.region_id)
            if remote is None:
                return f"peer {handle.peer_id!r} has no region {region_ops.region_id}"
            local = _Region(local_desc.address, local_desc.size)
            for op in region_ops.ops:
                if (
                    op.length < 0
                    or op.local_offset < 0
                    or op.remote_offset < 0
                    or op.local_offset + op.length > local.size
                    or op.remote_offset + op.length > remote.size
                ):
                    return (
                        f"region {region_ops.region_id}: copy local_offset={op.local_offset} "
                        f"remote_offset={op.remote_offset} length={op.length} is out of bounds "
                        f"(local size {local.size}, remote size {remote.size})"
                    )
                local_address = local.address + op.local_offset
                remote_address = remote.address + op.remote_offset
                if write:
                    copies.append((remote_address, local_address, op.length))
                else:
                    copies.append((local_address, remote_address, op.length))
        memmove = ctypes.memmove
        for dst, src, length in copies:
            memmove(dst, src, length)
        hook = self._copy_hook
        if hook is not None:
            hook(handle.direction, [(dst, length) for dst, _, length in copies])
        return None
