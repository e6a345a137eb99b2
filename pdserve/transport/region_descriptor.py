"""`RegionDescriptor`: what a peer needs to reach one of our regions, and its wire form.

Host-memory regions travel exactly as before device memory existed (the four keys region_id,
size, shm_name, address), so peers of older releases still parse them. A region on a device adds
`device` ("cuda:0"); one a same-host peer can map through an IPC handle adds `ipc` (see
ipc_handle.py). A peer that does not know those keys refuses such a descriptor, which is right:
it could not reach device memory anyway.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.errors import ProtocolError
from pdserve.transport.device import CPU, MemoryDevice
from pdserve.transport.ipc_handle import IpcHandle
from pdserve.transport.shared_segment import segment_name_problem

MAX_REGION_ID = (1 << 16) - 1
MAX_REGION_BYTES = 1 << 48
_KEYS = frozenset({"region_id", "size", "shm_name", "address"})
_OPTIONAL_KEYS = frozenset({"device", "ipc"})


@dataclass(frozen=True)
class RegionDescriptor:
    """What a peer needs to reach one of our regions: its id, size and how to map it.

    `shm_name` is the POSIX shm segment (a file name in /dev/shm) backing the region, for the
    shm backend; `address` is the region's virtual address in the owner's process, for backends
    that address remote memory directly (NIXL). `device` says where the bytes live (host memory
    by default); `ipc` is how a process on the same host maps a device region (gpu-ipc backend).
    Any of shm_name, address and ipc may be None.
    """

    region_id: int
    size: int
    shm_name: str | None
    address: int | None
    device: MemoryDevice = CPU
    ipc: IpcHandle | None = None

    def to_wire(self) -> dict:
        wire = {
            "region_id": self.region_id,
            "size": self.size,
            "shm_name": self.shm_name,
            "address": self.address,
        }
        if not self.device.is_cpu:
            wire["device"] = self.device.to_wire()
        if self.ipc is not None:
            wire["ipc"] = self.ipc.to_wire()
        return wire

    @classmethod
    def from_wire(cls, data: dict) -> RegionDescriptor:
        """Parse a peer's descriptor; ProtocolError naming the field that is missing, of the
        wrong type (bools are not integers here) or out of range."""
        if not isinstance(data, dict) or not (_KEYS <= set(data) <= _KEYS | _OPTIONAL_KEYS):
            raise ProtocolError(
                f"region descriptor must have exactly the keys {sorted(_KEYS)} (and optionally "
                f"{sorted(_OPTIONAL_KEYS)}), got {data!r:.200}"
            )
        region_id, size, shm_name, address = (data[k] for k in ("region_id", "size", "shm_name", "address"))
        _check_int(region_id, "region_id", 0, MAX_REGION_ID)
        _check_int(size, "size", 1, MAX_REGION_BYTES)
        if address is not None:
            _check_int(address, "address", 0, (1 << 64) - 1)
        if shm_name is not None:
            problem = segment_name_problem(shm_name)
            if problem is not None:
                raise ProtocolError(f"region descriptor {region_id}: {problem}")
        try:
            device = MemoryDevice.parse(data["device"]) if "device" in data else CPU
            ipc = IpcHandle.from_wire(data["ipc"]) if "ipc" in data else None
        except ProtocolError as e:
            raise ProtocolError(f"region descriptor {region_id}: {e}") from None
        return cls(region_id, size, shm_name, address, device, ipc)


def _check_int(value, name: str, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ProtocolError(f"region descriptor {name} must be an integer, got {type(value).__name__} {value!r:.40}")
    if not low <= value <= high:
        raise ProtocolError(f"region descriptor {name} {value} is outside {low}..{high}")
