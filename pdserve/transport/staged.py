"""Host staging (`kv_buffer_device: cpu`): device KV moves through a pinned host mirror.

For devices or fabrics without peer access (no IPC between the two GPUs, NIXL without GPU
memory support): each device storage registered with `register_tensor` gets a mirror of the same
size in a shm segment, page-locked (`pin`), and the mirror is what the inner transport (shm on
one host, NIXL across hosts, or the per-peer choice of both) registers and peers reach, as
plain host memory; their descriptors are the host ones of today. Offsets are the same in the
device storage and its mirror, so a batch's ops apply to both. A batch is then a chain of steps,
driven by this transport's copy thread:
- WRITE: stage (device -> mirror, after the ready event recorded at submit), then the inner
  WRITE from our mirror into the peer's;
- READ: the inner READ from the peer's mirror into ours, then land (mirror -> device).
The passive side of a transfer is not told which bytes move, so the connector calls the step
itself: `stage(batch)` on P before D may READ blocks (the hold's blocks, once computed), and
`land(batch)` on D after P's WRITE of them completed, before the blocks are used. Both return a
handle like `submit`. Every step carries the batch's deadline (device_copy.py's rules for the
device steps; the inner transport's for the host one); the first failing step fails the batch.
The inner transport's `submit` is called from this transport's copy thread (it only queues).

Device <-> host copies go run by run (copy_plan.py): with fragmented blocks that is one DMA per
block, which scripts/gpu_check.py does not measure yet (it checks gpu-ipc).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

from pdserve.errors import TransferError
from pdserve.transport.base import Direction, RegionDescriptor, RegionOps, TransferHandle, TransferStatus, Transport
from pdserve.transport.copy_plan import plan_windows
from pdserve.transport.copy_thread import CopyThreadTransport, Job
from pdserve.transport.device import CPU, MemoryDevice
from pdserve.transport.device_backend import DeviceBackend
from pdserve.transport.device_copy import DeviceCopier, DeviceCopy, Part
from pdserve.transport.shared_segment import SharedSegment, segment_name

logger = logging.getLogger(__name__)

POLL_INTERVAL_S = 0.0002
SETTLE_DEADLINE_S = 5.0
STAGE, REMOTE, LAND = "stage", "remote", "land"
LOCAL_PEER = ""  # the peer id of stage (WRITE) and land (READ) handles: no peer has it


@dataclass
class _Mirror:
    device: object  # the device storage, as a byte tensor
    host: object  # the pinned mirror, as a byte tensor
    segment: SharedSegment


@dataclass(eq=False)
class _Chain:
    job: Job
    steps: list[str]
    step: int = 0
    inner: TransferHandle | None = None  # the REMOTE step's handle while it runs
    began: float = 0.0


class StagedTransport(CopyThreadTransport):
    """See the module docstring. `inner` moves host memory (ShmTransport, NixlTransport or their
    RoutedTransport); its other calls (local_endpoint, transport_of, ...) pass through."""

    def __init__(self, backend: DeviceBackend, inner: Transport, token: str, name: str = "staged",
                 poll_interval_s: float = POLL_INTERVAL_S):
        super().__init__(name)
        self.inner = inner
        self._backend = backend
        self._token = token  # names our mirror segments
        self._poll_interval_s = poll_interval_s
        self._mirrors: dict[int, _Mirror] = {}
        self._chains: list[_Chain] = []
        self._count = itertools.count()
        self._copier = DeviceCopier(backend)
        self._start_copy_thread()

    # ---- regions and peers (worker thread) -------------------------------------------------

    def register_tensor(self, region_id: int, tensor) -> RegionDescriptor:
        """Give the storage under `tensor` a pinned host mirror, registered with the inner
        transport as region `region_id`; returns the mirror's (host) descriptor."""
        import torch  # lazy: heavy; this module imports without torch, only its tensor code needs it

        if region_id in self._local:
            raise ValueError(f"region {region_id} is already registered")
        storage = tensor.untyped_storage()
        device_bytes = torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(storage)
        size = device_bytes.numel()
        segment = SharedSegment.create(segment_name(self._token, f"stage{next(self._count)}"), size)
        host = torch.frombuffer(memoryview(segment.mmap), dtype=torch.uint8)
        try:
            self._backend.pin(host)
            desc = self.inner.register_region(region_id, segment.address, size, segment.unlink_name())
        except Exception:
            del host
            segment.close()
            raise
        self._mirrors[region_id] = _Mirror(device_bytes, host, segment)
        self._local[region_id] = RegionDescriptor(region_id, size, None, device_bytes.data_ptr(),
                                                  MemoryDevice.of_tensor(tensor))
        return desc

    def register_region(
        self, region_id: int, address: int, size: int, shm_name: str | None = None, *, device: MemoryDevice = CPU
    ) -> RegionDescriptor:
        raise TransferError("host staging mirrors device storages: register them with register_tensor")

    def local_descriptors(self) -> list[RegionDescriptor]:
        return self.inner.local_descriptors()

    def attach_peer(self, peer_id: str, descriptors: list[RegionDescriptor], *route) -> None:
        self.inner.attach_peer(peer_id, descriptors, *route)

    def detach_peer(self, peer_id: str) -> None:
        self.inner.detach_peer(peer_id)

    def __getattr__(self, name: str):
        if name.startswith("_") or name == "inner":  # ours only; public extras of the inner transport pass
            raise AttributeError(name)
        return getattr(self.inner, name)

    # ---- transfers (worker thread) -----------------------------------------------------------

    def stage(self, batch: Sequence[RegionOps], *, not_after: float | None = None) -> TransferHandle:
        """Copy the batch's local ranges from the device into the mirror (P, before a READ)."""
        return self.submit(LOCAL_PEER, Direction.WRITE, batch, not_after=not_after)

    def land(self, batch: Sequence[RegionOps], *, not_after: float | None = None) -> TransferHandle:
        """Copy the batch's local ranges from the mirror into the device (D, after a WRITE)."""
        return self.submit(LOCAL_PEER, Direction.READ, batch, not_after=not_after)

    # ---- copy thread -----------------------------------------------------------------------

    def _mark_ready(self) -> object:
        return self._backend.record_ready()

    def _poll_interval(self) -> float | None:
        return self._poll_interval_s if self._chains else None

    def _copy(self, job: Job) -> None:
        handle = job.handle
        write = handle.direction is Direction.WRITE
        if handle.peer_id == LOCAL_PEER:
            steps = [STAGE] if write else [LAND]
        else:
            steps = [STAGE, REMOTE] if write else [REMOTE, LAND]
        problem = self._check_local(job)
        if problem is not None:
            handle.finish(TransferStatus.FAILED, problem)
            return
        chain = _Chain(job, steps, began=time.perf_counter())
        self._chains.append(chain)
        self._start_step(chain)

    def _check_local(self, job: Job) -> str | None:
        for region_ops in job.batch:
            local = self._local.get(region_ops.region_id)
            if local is None:
                return f"no local region {region_ops.region_id}"
            for op in region_ops.ops:
                if op.length < 0 or op.local_offset < 0 or op.local_offset + op.length > local.size:
                    return (f"region {region_ops.region_id}: copy local_offset={op.local_offset} "
                            f"length={op.length} is out of bounds (local size {local.size})")
        return None

    def _start_step(self, chain: _Chain) -> None:
        handle = chain.job.handle
        if chain.steps[chain.step] == REMOTE:
            chain.inner = self.inner.submit(handle.peer_id, handle.direction, chain.job.batch, not_after=handle.not_after)
            self._check_inner(chain)
            return
        to_host = chain.steps[chain.step] == STAGE
        parts = []
        for region_ops in chain.job.batch:
            mirror = self._mirrors[region_ops.region_id]
            src, dst = (mirror.device, mirror.host) if to_host else (mirror.host, mirror.device)
            runs = ((op.local_offset, op.local_offset, op.length) for op in region_ops.ops)
            parts.extend(Part(src, dst, window) for window in plan_windows(runs))
        ready, chain.job = chain.job.ready, chain.job._replace(ready=None)  # the first device step waits
        self._copier.start(DeviceCopy(parts, handle.not_after, lambda copy: self._step_done(chain, copy.error), ready))

    def _check_inner(self, chain: _Chain) -> None:
        status = chain.inner.status
        if status is not TransferStatus.PENDING:
            self._step_done(chain, chain.inner.error if status is TransferStatus.FAILED else None)

    def _step_done(self, chain: _Chain, error: str | None) -> None:
        chain.inner = None
        failed_step = chain.steps[chain.step]
        chain.step += 1
        if error is None and chain.step < len(chain.steps):
            if not self._closed:
                self._start_step(chain)
                return
            error, failed_step = f"transport {self.name} closed during the transfer", chain.steps[chain.step]
        self._chains.remove(chain)
        handle = chain.job.handle
        handle.copy_seconds = time.perf_counter() - chain.began
        if error is None:
            handle.finish(TransferStatus.DONE)
        else:
            handle.finish(TransferStatus.FAILED, f"{failed_step}: {error}")

    def _progress(self) -> None:
        self._copier.progress()
        for chain in [c for c in self._chains if c.inner is not None]:
            self._check_inner(chain)

    def _close_backend(self) -> None:
        self._copier.stop_all(f"transport {self.name} closed during the transfer")
        deadline = time.monotonic() + SETTLE_DEADLINE_S
        while self._chains and time.monotonic() < deadline:
            time.sleep(self._poll_interval_s)
            self._progress()
        self.inner.close()
        self._progress()  # the inner transport failed what it still had
        if self._chains:
            logger.error("transport %s: %d transfers still in flight at close; their mirrors stay mapped",
                         self.name, len(self._chains))
            return
        for mirror in self._mirrors.values():
            try:
                self._backend.unpin(mirror.host)
            except Exception as exc:  # noqa: BLE001 - closing: log and go on
                logger.warning("transport %s: unpinning a staging mirror failed: %s", self.name, exc)
            mirror.host = None
            mirror.segment.close()
        self._mirrors = {}
