"""The Transport interface: move byte ranges between registered memory regions of two peers.

A region is one contiguous span of memory (a KV cache storage, usually). Each side registers its
own regions, sends the descriptors to its peer over the control plane, and the peer attaches them.
After that, one side moves batches of `(local_offset, remote_offset, length)` copies:
WRITE pushes local bytes into the peer's region, READ pulls the peer's bytes into ours.

Backends know nothing of vLLM, blocks or requests: the connector turns block ids into byte
offsets (`block_copy_ops`) and hands the transport plain copy lists.
"""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from enum import Enum
from typing import NamedTuple

from pdserve.errors import TransferTimeout
from pdserve.transport.device import CPU, MemoryDevice
from pdserve.transport.region_descriptor import (  # noqa: F401 - their home now; still importable from here
    MAX_REGION_BYTES,
    MAX_REGION_ID,
    RegionDescriptor,
)


class CopyOp(NamedTuple):
    """One copy of `length` bytes, offsets relative to the start of a local and a remote region."""

    local_offset: int
    remote_offset: int
    length: int


class RegionOps(NamedTuple):
    """The copies of one batch that touch region `region_id` (same id on both sides)."""

    region_id: int
    ops: tuple[CopyOp, ...]


class Direction(Enum):
    WRITE = "WRITE"  # local -> remote
    READ = "READ"  # remote -> local


class TransferStatus(Enum):
    PENDING = "PENDING"
    DONE = "DONE"
    FAILED = "FAILED"


class TransferHandle:
    """One submitted batch. Its status goes once from PENDING to DONE or FAILED: set by the
    transport, or by `cancel` while the copy has not started. `not_after` (a time.monotonic()
    deadline, or None) is the latest moment the copy may touch memory at all: a batch not begun
    by then fails without copying, a running one is stopped (shm: before its next chunk), and one
    that cannot be stopped (a NIXL request in flight) fails once it ended. A handle finishes only
    when nothing of its copy can move any more: one that stays PENDING past `not_after` is a copy
    still running, so its memory must not be reused."""

    def __init__(self, peer_id: str, direction: Direction, num_bytes: int, not_after: float | None = None):
        self.peer_id = peer_id
        self.direction = direction
        self.num_bytes = num_bytes
        self.not_after = not_after
        self.status = TransferStatus.PENDING
        self.error: str | None = None
        self.started = time.monotonic()  # submit time
        self.finished: float | None = None
        self.copy_seconds: float | None = None  # time spent copying, queueing excluded (set by the backend)
        self._copying = False
        self._lock = threading.Lock()
        self._done = threading.Event()

    @property
    def seconds(self) -> float | None:
        """Time from submit to completion, None while pending."""
        return None if self.finished is None else self.finished - self.started

    def begin(self) -> bool:
        """Called by the transport right before copying: False if the handle is already
        finished (cancelled), else it can no longer be cancelled."""
        with self._lock:
            if self.status is not TransferStatus.PENDING:
                return False
            self._copying = True
            return True

    def cancel(self, error: str = "cancelled") -> bool:
        """Fail the handle if its copy has not begun; True if it did, False if it is copying or
        finished already."""
        with self._lock:
            if self._copying or self.status is not TransferStatus.PENDING:
                return False
            self._finish(TransferStatus.FAILED, error)
            return True

    def finish(self, status: TransferStatus, error: str | None = None) -> None:
        """Called by the transport, exactly once, when the batch completed or failed."""
        with self._lock:
            self._finish(status, error)

    def _finish(self, status: TransferStatus, error: str | None) -> None:
        if status is TransferStatus.PENDING:
            raise ValueError("a transfer can only finish as DONE or FAILED")
        if self.status is not TransferStatus.PENDING:
            raise RuntimeError(f"transfer already finished: expected PENDING, found {self.status.name}")
        self.error = error
        self.finished = time.monotonic()
        self.status = status
        self._done.set()

    def wait(self, timeout_s: float) -> bool:
        """Block until finished or `timeout_s` elapsed; True when finished."""
        return self._done.wait(timeout_s)

    def __repr__(self) -> str:
        return (
            f"TransferHandle(peer={self.peer_id!r}, {self.direction.name}, {self.num_bytes} B, "
            f"{self.status.name}{', ' + self.error if self.error else ''})"
        )


class Transport(ABC):
    """Moves bytes between our registered regions and an attached peer's regions.

    Called by the connector's worker half: `register_region` once per KV cache storage at
    startup, `local_descriptors` to fill the handshake reply, `attach_peer` when a handshake
    with a peer succeeds, then `submit`/`poll`/`wait` per transfer, `close` at shutdown.
    A transport is used from one thread (the connector's); completion happens in the background.
    """

    @abstractmethod
    def register_region(
        self, region_id: int, address: int, size: int, shm_name: str | None = None, *, device: MemoryDevice = CPU
    ) -> RegionDescriptor:
        """Declare `size` bytes of local memory at `address` that peers may read and write.

        `shm_name` names the POSIX shm segment holding that memory (the shm backend requires it
        so the peer can map the region). `device` is where the memory is: host memory unless
        said otherwise; a backend that cannot reach memory on that device raises TransferError
        (shm moves host memory only; NIXL registers device memory as VRAM). Device memory a
        same-host peer maps through IPC is registered with `GpuIpcTransport.register_tensor`
        instead, which needs the tensor. Registering an id twice raises ValueError.
        """

    @abstractmethod
    def local_descriptors(self) -> list[RegionDescriptor]:
        """The descriptors of every registered local region, in region id order."""

    @abstractmethod
    def attach_peer(self, peer_id: str, descriptors: list[RegionDescriptor]) -> None:
        """Make a peer's regions reachable. Idempotent: attaching the same descriptors again is a
        no-op; attaching different ones replaces the old mapping.

        Raises TransferError naming every region that cannot be reached (shm segment missing or
        smaller than its descriptor says); the peer is then left detached.
        """

    @abstractmethod
    def detach_peer(self, peer_id: str) -> None:
        """Forget a peer (unmap its regions). Unknown peers are ignored."""

    @abstractmethod
    def submit(
        self, peer_id: str, direction: Direction, batch: Sequence[RegionOps], *, not_after: float | None = None
    ) -> TransferHandle:
        """Start copying `batch` to (WRITE) or from (READ) the peer; returns at once.

        Never raises for a bad batch: an unknown peer or region, or an op out of either region's
        bounds, fails the handle (status FAILED, `error` naming region, offset and length) before
        any byte of the batch is copied. A batch whose copy would begin after `not_after` (a
        time.monotonic() deadline) fails with "deadline passed before the copy started"; one
        still running at `not_after` is stopped and fails with "deadline passed during the copy"
        (some of its bytes may have landed, none lands after its handle finished).
        """

    def cancel(self, handle: TransferHandle) -> bool:
        """Fail `handle` (status FAILED, error "cancelled") if its copy has not begun; returns
        True then, False when it is already copying or finished. Batches run one after another,
        and each is checked right before it begins."""
        return handle.cancel()

    def poll(self, handle: TransferHandle) -> TransferStatus:
        """The handle's current status, without blocking."""
        return handle.status

    def wait(self, handle: TransferHandle, timeout_s: float) -> TransferStatus:
        """Block until the handle is finished; raises TransferTimeout after `timeout_s`."""
        if not handle.wait(timeout_s):
            raise TransferTimeout(f"transfer {handle!r} not finished after {timeout_s:.3f} s")
        return handle.status

    @abstractmethod
    def close(self) -> None:
        """Fail pending transfers, join background threads, unmap peers. Idempotent."""

    def __enter__(self) -> Transport:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def merge_contiguous(ops: Iterable[CopyOp]) -> tuple[CopyOp, ...]:
    """Sort by local offset and coalesce neighbours contiguous on both sides into one copy."""
    merged: list[CopyOp] = []
    for op in sorted(ops, key=lambda o: (o.local_offset, o.remote_offset)):
        if op.length == 0:
            continue
        if merged:
            last = merged[-1]
            if (
                last.local_offset + last.length == op.local_offset
                and last.remote_offset + last.length == op.remote_offset
            ):
                merged[-1] = CopyOp(last.local_offset, last.remote_offset, last.length + op.length)
                continue
        merged.append(op)
    return tuple(merged)


def block_copy_ops(
    local_block_ids: Sequence[int],
    remote_block_ids: Sequence[int],
    block_bytes: int,
    *,
    block_stride: int | None = None,
    local_base: int = 0,
    remote_base: int = 0,
) -> tuple[CopyOp, ...]:
    """Copies that move local block `l[i]` to/from remote block `r[i]`, merged where contiguous.

    Block `b` starts at `base + b * block_stride` (stride defaults to `block_bytes`, i.e. blocks
    packed back to back); `block_bytes` bytes of it are copied.
    """
    if len(local_block_ids) != len(remote_block_ids):
        raise ValueError(
            f"block id lists differ in length: {len(local_block_ids)} local, {len(remote_block_ids)} remote"
        )
    stride = block_bytes if block_stride is None else block_stride
    return merge_contiguous(
        CopyOp(local_base + local * stride, remote_base + remote * stride, block_bytes)
        for local, remote in zip(local_block_ids, remote_block_ids)
    )
