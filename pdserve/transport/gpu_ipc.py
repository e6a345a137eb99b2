"""Same-host GPU transport (`transport: gpu-ipc`): peers map each other's device memory via IPC.

Each side registers its KV storages with `register_tensor`: the descriptor carries an IPC handle
(ipc_handle.py) bound to this process's incarnation. A peer on the same host opens those handles
in `attach_peer`, so the peer's KV is a tensor here, and a batch is device-to-device copies
between our tensor and the peer's, issued by this process on its own side stream:
- `submit` records a ready event on the compute stream (the KV of the layers computed so far),
  and the copy thread issues the batch's copies once that event completed (device_copy.py), as
  windows of merged block runs (copy_plan.py: one gather and one scatter per window, not a copy
  per block);
- completion is the window events, polled by the copy thread; the deadline and the peer's
  incarnation are checked before every window, and a handle fails only when no byte of its
  batch can land any more;
- a peer whose process exited (or was replaced) is not used again: its copies fail, and its
  mappings are released as soon as no copy of ours uses them. Detaching a peer waits the same way.

The device calls go through a DeviceBackend (CUDA, or CPU tensors standing in: cpu_backend.py).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import NamedTuple

from pdserve.errors import TransferError
from pdserve.transport.base import Direction, RegionDescriptor, TransferStatus
from pdserve.transport.copy_plan import plan_windows
from pdserve.transport.copy_thread import CopyThreadTransport, Job
from pdserve.transport.device import CPU, MemoryDevice
from pdserve.transport.device_backend import DeviceBackend
from pdserve.transport.device_copy import DeviceCopier, DeviceCopy, Part
from pdserve.transport.peer_regions import PeerRegions

logger = logging.getLogger(__name__)

POLL_INTERVAL_S = 0.0002  # how often the copy thread polls events while copies are in flight
SETTLE_DEADLINE_S = 5.0  # at close, how long copies in flight may take to complete


class GpuIpcUsage(NamedTuple):
    """What the transport holds right now (for checks that everything was released)."""

    peers: int
    mapped_regions: int  # peer regions mapped here, attached or waiting for their copies to end
    copies: int  # batches admitted and not yet settled


class GpuIpcTransport(CopyThreadTransport):
    """See the module docstring."""

    def __init__(self, backend: DeviceBackend, name: str = "gpu-ipc", poll_interval_s: float = POLL_INTERVAL_S):
        super().__init__(name)
        self._backend = backend
        self._poll_interval_s = poll_interval_s
        self._data: dict[int, object] = {}  # region id -> our storage as a byte tensor
        self._peers: dict[str, PeerRegions] = {}
        self._retired: list[PeerRegions] = []  # detached or dead, unmapped once no copy uses them
        self._lock = threading.Lock()  # peers and mappings: the worker thread attaches, the copy thread copies
        self._copies_pending = 0
        self._copier = DeviceCopier(backend)
        self._start_copy_thread()

    # ---- regions and peers (worker thread) -------------------------------------------------

    def register_tensor(self, region_id: int, tensor) -> RegionDescriptor:
        """Register the whole storage under `tensor` as region `region_id`, shared by IPC."""
        if region_id in self._local:
            raise ValueError(f"region {region_id} is already registered")
        device = MemoryDevice.of_tensor(tensor)
        if device != self._backend.device:
            raise TransferError(f"region {region_id} is on {device}, the transport drives {self._backend.device}")
        exported = self._backend.export(tensor)
        desc = RegionDescriptor(region_id, exported.data.numel(), None, exported.data.data_ptr(), device, exported.ipc)
        self._data[region_id] = exported.data
        self._local[region_id] = desc
        return desc

    def register_region(
        self, region_id: int, address: int, size: int, shm_name: str | None = None, *, device: MemoryDevice = CPU
    ) -> RegionDescriptor:
        raise TransferError("transport gpu-ipc shares storages through IPC handles, which need the tensor: "
                            "register it with register_tensor")

    def attach_peer(self, peer_id: str, descriptors: list[RegionDescriptor]) -> None:
        """Open the peer's IPC handles (see Transport.attach_peer); TransferError naming each region
        that cannot be mapped, or when the process that exported them is gone."""
        wanted = tuple(sorted(descriptors, key=lambda d: d.region_id))
        current = self._peers.get(peer_id)
        if current is not None and current.descriptors == wanted and current.dead is None:
            return
        try:
            mapping = PeerRegions(self._backend, peer_id, wanted)
        except TransferError as e:
            self.detach_peer(peer_id)
            raise TransferError(f"peer {peer_id!r}: {e}") from None
        with self._lock:
            old = self._peers.get(peer_id)
            self._peers[peer_id] = mapping
            if old is not None:
                self._retire(old)

    def detach_peer(self, peer_id: str) -> None:
        """Forget the peer; its mappings end once the copies using them settled."""
        with self._lock:
            mapping = self._peers.pop(peer_id, None)
            if mapping is not None:
                self._retire(mapping)

    def usage(self) -> GpuIpcUsage:
        with self._lock:
            mappings = {id(m): m for m in [*self._peers.values(), *self._retired]}
            return GpuIpcUsage(len(self._peers), sum(m.num_mapped for m in mappings.values()), self._copies_pending)

    # ---- copy thread -----------------------------------------------------------------------

    def _mark_ready(self) -> object:
        return self._backend.record_ready()

    def _poll_interval(self) -> float | None:
        return self._poll_interval_s if self._copier.busy else None

    def _copy(self, job: Job) -> None:
        handle = job.handle
        with self._lock:
            mapping = self._peers.get(handle.peer_id)
            if mapping is None:
                handle.finish(TransferStatus.FAILED, f"peer {handle.peer_id!r} is not attached")
                return
            gone = mapping.check_alive()
            if gone is not None:
                self._retire(mapping)
                handle.finish(TransferStatus.FAILED, gone)
                return
            problem = self._resolve(job, mapping.region)
            if isinstance(problem, str):
                handle.finish(TransferStatus.FAILED, problem)
                return
            parts = self._parts(job, mapping)
            mapping.users += 1
            self._copies_pending += 1

        def on_done(copy: DeviceCopy) -> None:
            with self._lock:
                mapping.users -= 1
                self._copies_pending -= 1
                if copy.stopped is not None and mapping.check_alive() is not None:
                    self._retire(mapping)
                self._release_unused()
            handle.copy_seconds = copy.seconds
            error = copy.error
            if error is None:
                handle.finish(TransferStatus.DONE)
            else:
                logger.debug("transfer to %s failed: %s", handle.peer_id, error)
                handle.finish(TransferStatus.FAILED, error)

        self._copier.start(DeviceCopy(parts, handle.not_after, on_done, job.ready, mapping.check_alive))

    def _parts(self, job: Job, mapping: PeerRegions) -> list[Part]:
        """The batch's windows, per region, oriented source -> destination."""
        parts = []
        write = job.handle.direction is Direction.WRITE
        for region_ops in job.batch:
            local, remote = self._data[region_ops.region_id], mapping.data(region_ops.region_id)
            src, dst = (local, remote) if write else (remote, local)
            runs = ((op.local_offset, op.remote_offset, op.length) if write else
                    (op.remote_offset, op.local_offset, op.length) for op in region_ops.ops)
            parts.extend(Part(src, dst, window) for window in plan_windows(runs))
        return parts

    def _progress(self) -> None:
        self._copier.progress()

    # ---- mappings (lock held) ----------------------------------------------------------------

    def _retire(self, mapping: PeerRegions) -> None:
        """Unmap `mapping` as soon as no copy uses it. A dead peer's mapping is retired while the
        peer stays attached (as dead, so that its transfers fail at once) until it is detached."""
        if mapping not in self._retired:
            self._retired.append(mapping)
        self._release_unused()

    def _release_unused(self) -> None:
        for mapping in [m for m in self._retired if m.users == 0]:
            mapping.close()
            self._retired.remove(mapping)

    def _close_backend(self) -> None:
        self._copier.stop_all(f"transport {self.name} closed during the transfer")
        deadline = time.monotonic() + SETTLE_DEADLINE_S
        while self._copier.busy and time.monotonic() < deadline:
            time.sleep(self._poll_interval_s)
            self._copier.progress()
        if self._copier.busy:
            logger.error("transport %s: copies still in flight after %.0f s; their memory stays mapped",
                         self.name, SETTLE_DEADLINE_S)
            return
        with self._lock:
            peers, self._peers = self._peers, {}
            for mapping in peers.values():
                self._retire(mapping)
