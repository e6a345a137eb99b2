"""Same-host transport: the peer's regions are POSIX shm segments we map; copies are memmoves.

No socket and no serialisation on the data path: the copy thread (copy_thread.py) runs each
submitted batch as a series of `ctypes.memmove` calls (which release the GIL) between our region
and the mapped peer region, then marks the batch's handle DONE or FAILED. Copies move in chunks
of at most CHUNK_BYTES, and the batch's `not_after` deadline is checked before each chunk: once
it passed, the batch stops and fails, so no byte of it lands more than one chunk's memmove after
its deadline (in a process that is not frozen).
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import NamedTuple

from pdserve.errors import TransferError
from pdserve.transport.base import Direction, RegionDescriptor, TransferStatus
from pdserve.transport.copy_thread import CopyThreadTransport, Job, past
from pdserve.transport.device import MemoryDevice
from pdserve.transport.shared_segment import SharedSegment

logger = logging.getLogger(__name__)

CHUNK_BYTES = 4 << 20  # the most one memmove moves between two deadline checks

# Called on the copy thread after a batch's bytes landed, before its handle turns DONE, with the
# (address, length) ranges written in this process's address space. Test hooks only.
CopyHook = Callable[[Direction, list[tuple[int, int]]], None]


class _Region(NamedTuple):
    address: int
    size: int


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


class ShmTransport(CopyThreadTransport):
    """Transport between processes on one host through shm segments (see module docstring)."""

    def __init__(self, name: str = "shm"):
        super().__init__(name)
        self._peers: dict[str, _PeerMapping] = {}
        self._copy_hook: CopyHook | None = None
        self._mapping_lock = threading.Lock()  # held while copying, so peers are never unmapped mid-copy
        self._start_copy_thread()

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

    def _register_memory(self, address: int, size: int, device: MemoryDevice) -> None:
        if not device.is_cpu:
            raise TransferError(f"transport {self.name} moves host memory only, not memory on {device} "
                                "(use transport gpu-ipc, or kv_buffer_device cpu)")

    def set_copy_hook(self, hook: CopyHook | None) -> None:
        """Install a hook run after each successful batch (test-only; see pdserve/faults)."""
        self._copy_hook = hook

    def _close_backend(self) -> None:
        with self._mapping_lock:
            peers, self._peers = self._peers, {}
        for mapping in peers.values():
            mapping.close()

    def _copy(self, job: Job) -> None:
        handle = job.handle
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

    def _execute(self, job: Job) -> str | None:
        """Check every op, then copy them all; returns an error message or None."""
        handle = job.handle
        mapping = self._peers.get(handle.peer_id)
        if mapping is None:
            return f"peer {handle.peer_id!r} is not attached"
        copies = self._resolve(job, mapping.region)
        if isinstance(copies, str):
            return copies
        error = self._move(copies, handle.direction is Direction.WRITE, handle.not_after)
        if error is not None:
            return error
        hook = self._copy_hook
        if hook is not None:
            if handle.direction is Direction.WRITE:
                written = [(remote, length) for _, remote, length in copies]
            else:
                written = [(local, length) for local, _, length in copies]
            hook(handle.direction, written)
        return None

    @staticmethod
    def _move(copies: list, write: bool, not_after: float | None) -> str | None:
        """memmove every copy, chunk by chunk, checking `not_after` before each chunk; the error
        when the deadline passed first."""
        memmove = ctypes.memmove
        total = sum(length for _, _, length in copies)
        moved = 0
        for local, remote, length in copies:
            src, dst = (local, remote) if write else (remote, local)
            for start in range(0, length, CHUNK_BYTES):
                if past(not_after):
                    return f"deadline passed during the copy ({moved} of {total} bytes moved)"
                size = min(CHUNK_BYTES, length - start)
                memmove(dst + start, src + start, size)
                moved += size
        return None
