"""ShmTransport vs an in-process memcpy of the same scattered 64 KiB blocks; prints GB/s.

The peer region lives in another process (spawn), as in a real P/D pair. Fixed seed, one warm-up,
best of N rounds. Usage: python scripts/bench_transport.py [--total-mib 256] [--rounds 5]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import time

import numpy as np

from pdserve.transport import (
    Direction,
    RegionDescriptor,
    RegionOps,
    SharedSegment,
    ShmTransport,
    block_copy_ops,
    segment_name,
)

BLOCK = 64 * 1024


def _owner(conn, size: int) -> None:
    segment = SharedSegment.create(segment_name("bench", "pool"), size)
    np.frombuffer(segment.mmap, dtype=np.uint8)[:] = 1
    conn.send(segment.name)
    conn.recv()
    segment.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--total-mib", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    num_blocks = args.total_mib * 1024 * 1024 // BLOCK
    pool_blocks = 2 * num_blocks
    rng = np.random.default_rng(0)
    remote_ids = rng.choice(pool_blocks, num_blocks, replace=False).tolist()
    local_ids = rng.permutation(num_blocks).tolist()  # scattered on both sides: nothing merges
    ops = block_copy_ops(local_ids, remote_ids, BLOCK)
    num_bytes = num_blocks * BLOCK

    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=_owner, args=(child, pool_blocks * BLOCK), daemon=True)
    proc.start()
    local = SharedSegment.create(segment_name("bench", "local"), num_bytes)
    local_array = np.frombuffer(local.mmap, dtype=np.uint8)
    local_array[:] = 2
    try:
        name = conn.recv()
        with ShmTransport() as transport:
            transport.register_region(0, local.address, local.size, local.name)
            transport.attach_peer("pool", [RegionDescriptor(0, pool_blocks * BLOCK, name, None)])
            results = {}
            for direction in (Direction.READ, Direction.WRITE):
                best = float("inf")
                for _ in range(args.rounds + 1):  # first round warms up
                    handle = transport.submit("pool", direction, [RegionOps(0, ops)])
                    transport.wait(handle, 60)
                    assert handle.error is None, handle.error
                    best = min(best, handle.seconds)
                results[direction.name] = num_bytes / best / 1e9

        pool = np.ones(pool_blocks * BLOCK, dtype=np.uint8)
        best = float("inf")
        for _ in range(args.rounds + 1):
            start = time.perf_counter()
            for op in ops:
                np.copyto(local_array[op.local_offset : op.local_offset + op.length],
                          pool[op.remote_offset : op.remote_offset + op.length])
            best = min(best, time.perf_counter() - start)
        memcpy_gbs = num_bytes / best / 1e9
        contiguous = float("inf")
        for _ in range(args.rounds + 1):
            start = time.perf_counter()
            np.copyto(local_array, pool[:num_bytes])
            contiguous = min(contiguous, time.perf_counter() - start)
    finally:
        del local_array
        conn.send("exit")
        proc.join(10)
        local.close()
    print(
        f"{num_blocks} x 64 KiB blocks ({args.total_mib} MiB), best of {args.rounds}: "
        f"ShmTransport READ {results['READ']:.2f} GB/s, WRITE {results['WRITE']:.2f} GB/s; "
        f"in-process np.copyto per block {memcpy_gbs:.2f} GB/s, contiguous {num_bytes / contiguous / 1e9:.2f} GB/s"
    )


if __name__ == "__main__":
    main()
