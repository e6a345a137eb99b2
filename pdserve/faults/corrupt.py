"""Test-only transport wrapper that corrupts every byte a transfer delivers.

Attached by the fault rig (rig.py) when `test_corrupt_transfers` is set, to prove that the decode
side really computes from the transferred KV (wrong bytes must show up as wrong output, or be
caught). After each batch's copies, before its handle turns DONE, the top bit of every second byte
is flipped (XOR 0x80 on odd offsets): on a WRITE in the peer's memory, on a READ in our own. For
little-endian 16-bit floats (the bf16 KV cache) that negates every value and keeps it finite, so
the model runs on and answers with wrong tokens instead of NaNs.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import numpy as np

from pdserve.transport.base import Direction, RegionDescriptor, RegionOps, TransferHandle, TransferStatus, Transport


def invert_bytes(ranges: list[tuple[int, int]]) -> None:
    """XOR 0x80 every odd-offset byte of each (address, length) range, in place."""
    for address, length in ranges:
        if length <= 0:
            continue
        view = np.ctypeslib.as_array((ctypes.c_uint8 * length).from_address(address))
        np.bitwise_xor(view[1::2], 0x80, out=view[1::2])


class CorruptingTransport(Transport):
    """Wraps a transport that supports copy hooks (ShmTransport) and corrupts what it delivers."""

    def __init__(self, inner: Transport):
        set_copy_hook = getattr(inner, "set_copy_hook", None)
        if set_copy_hook is None:
            raise TypeError(f"{type(inner).__name__} has no copy hook; cannot corrupt its transfers")
        self.inner = inner
        self.num_corrupted = 0
        set_copy_hook(self._corrupt)

    def _corrupt(self, direction: Direction, ranges: list[tuple[int, int]]) -> None:
        invert_bytes(ranges)
        self.num_corrupted += 1

    def register_region(
        self, region_id: int, address: int, size: int, shm_name: str | None = None
    ) -> RegionDescriptor:
        return self.inner.register_region(region_id, address, size, shm_name)

    def local_descriptors(self) -> list[RegionDescriptor]:
        return self.inner.local_descriptors()

    def attach_peer(self, peer_id: str, descriptors: list[RegionDescriptor]) -> None:
        self.inner.attach_peer(peer_id, descriptors)

    def detach_peer(self, peer_id: str) -> None:
        self.inner.detach_peer(peer_id)

    def submit(
        self, peer_id: str, direction: Direction, batch: Sequence[RegionOps], *, not_after: float | None = None
    ) -> TransferHandle:
        return self.inner.submit(peer_id, direction, batch, not_after=not_after)

    def cancel(self, handle: TransferHandle) -> bool:
        return self.inner.cancel(handle)

    def poll(self, handle: TransferHandle) -> TransferStatus:
        return self.inner.poll(handle)

    def wait(self, handle: TransferHandle, timeout_s: float) -> TransferStatus:
        return self.inner.wait(handle, timeout_s)

    def close(self) -> None:
        self.inner.close()

    def __getattr__(self, name: str):
        # backend-specific extras pass through
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)
