"""`PeerRegions`: one peer's device regions, mapped here through their IPC handles.

Bound to the incarnation that exported them (ipc_handle.py): mapping fails when that process is
gone, and `check_alive` notices when it goes later (the GPU transport asks before every window
it issues). `users` counts the copies using the mappings, so they are closed only when none does.
"""

from __future__ import annotations

from collections import Counter
from typing import NamedTuple

from pdserve.errors import TransferError
from pdserve.transport.base import RegionDescriptor
from pdserve.transport.device_backend import DeviceBackend, OpenedRegion


class _Region(NamedTuple):
    address: int
    size: int


class PeerRegions:
    """Maps every region of `descriptors` or raises TransferError naming each one it cannot (and
    maps nothing)."""

    def __init__(self, backend: DeviceBackend, peer_id: str, descriptors: tuple[RegionDescriptor, ...]):
        self.peer_id = peer_id
        self.descriptors = descriptors
        self.users = 0  # copies in progress through these mappings (the transport's lock guards it)
        self.dead: str | None = None  # why the exporting process is known gone
        self._opened: dict[int, OpenedRegion] = {}
        owners = {(d.ipc.owner_pid, d.ipc.owner_start) for d in descriptors if d.ipc is not None}
        self._owner = next((d.ipc for d in descriptors if d.ipc is not None), None)
        errors = []
        if len(owners) > 1:
            errors.append(f"the regions were exported by {len(owners)} processes, not one")
        region_ids = Counter(desc.region_id for desc in descriptors)
        for desc in descriptors:
            if region_ids[desc.region_id] > 1:
                errors.append(f"region {desc.region_id} is described more than once")
            elif desc.ipc is None:
                errors.append(f"region {desc.region_id} has no IPC handle (the peer does not run transport gpu-ipc)")
            elif desc.device.kind != backend.device.kind:
                errors.append(f"region {desc.region_id} is on {desc.device}; this transport maps {backend.device.kind} memory")
            elif (gone := desc.ipc.owner_gone()) is not None:
                errors.append(f"region {desc.region_id}: {gone}")
            else:
                try:
                    self._opened[desc.region_id] = backend.open(desc.ipc, desc.size)
                except TransferError as e:
                    errors.append(f"region {desc.region_id}: {e}")
        if errors:
            self.close()
            raise TransferError("cannot map the peer's regions: " + "; ".join(errors))
        self._sizes = {desc.region_id: desc.size for desc in descriptors}

    @property
    def num_mapped(self) -> int:
        return len(self._opened)

    def region(self, region_id: int) -> _Region | None:
        opened = self._opened.get(region_id)
        return None if opened is None else _Region(opened.data.data_ptr(), self._sizes[region_id])

    def data(self, region_id: int):
        """The mapped region as a byte tensor (only while mapped)."""
        return self._opened[region_id].data

    def check_alive(self) -> str | None:
        """None while the exporting process runs; else why not (remembered in `dead`)."""
        if self.dead is None and self._owner is not None:
            gone = self._owner.owner_gone()
            if gone is not None:
                self.dead = f"peer {self.peer_id!r}: {gone}"
        return self.dead

    def close(self) -> None:
        """Unmap every region (nothing may use them any more). Idempotent."""
        opened, self._opened = self._opened, {}
        for region in opened.values():
            region.close()
