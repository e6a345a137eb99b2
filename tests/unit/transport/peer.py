"""Code run in a second process (multiprocessing 'spawn') by the transport tests."""

from __future__ import annotations

import numpy as np

from pdserve.transport import SharedSegment, segment_name


def pattern(size: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)


def segment_owner(conn, token: str, size: int, seed: int) -> None:
    """Own a segment filled with `pattern(size, seed)`; answer commands over `conn` until 'exit'."""
    segment = SharedSegment.create(segment_name(token, "owner"), size)
    view = np.frombuffer(segment.mmap, dtype=np.uint8)
    view[:] = pattern(size, seed)
    conn.send(("ready", segment.name, segment.size))
    while True:
        command, *args = conn.recv()
        if command == "slice":
            start, stop = args
            conn.send(view[start:stop].tobytes())
        elif command == "exit":
            break
    del view
    segment.close()
    conn.send("closed")


def segment_leaker(conn, token: str, size: int) -> None:
    """Create a segment and exit without unlinking it (a crashed process)."""
    segment = SharedSegment.create(segment_name(token, "leak"), size)
    conn.send(segment.name)
    segment.mmap[:4] = b"leak"


def tensor_peer(conn, name: str) -> None:
    """Attach a segment, send its bytes, then write the (offset, data) we are sent."""
    segment = SharedSegment.attach(name)
    conn.send(bytes(segment.mmap[:]))
    offset, data = conn.recv()
    segment.mmap[offset : offset + len(data)] = data
    conn.send("written")
    segment.close(unlink=False)


def gpu_ipc_owner(conn, token: str, size: int, seed: int) -> None:
    """Own a GpuIpcTransport (CPU stand-in) with one region filled with `pattern(size, seed)`;
    send its descriptors, then answer 'bytes' and 'exit' commands."""
    import torch

    from pdserve.transport.cpu_backend import CpuStandIn
    from pdserve.transport.gpu_ipc import GpuIpcTransport

    tensor = torch.from_numpy(pattern(size, seed).copy())
    transport = GpuIpcTransport(CpuStandIn(token))
    transport.register_tensor(0, tensor)
    conn.send([d.to_wire() for d in transport.local_descriptors()])
    while True:
        command, *args = conn.recv()
        if command == "bytes":
            start, stop = args
            conn.send(tensor[start:stop].numpy().tobytes())
        elif command == "exit":
            break
    transport.close()
    conn.send("closed")
