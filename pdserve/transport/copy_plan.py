"""How a batch's copies become a few device operations: windows of merged runs, gathered at once.

A batch arrives as merged runs (the connector coalesced neighbouring blocks; `merge_contiguous`).
`plan_windows` cuts them into windows of at most WINDOW_BYTES, the unit the copy engine issues
and checks its deadline between. `enqueue_window` issues one window with no Python loop over
blocks: a few runs are copied one `copy_` each (a DMA per run, the fastest for long runs), many
runs with one gather and one scatter over row indices (`index_select` + `index_copy_`, two
kernels whatever the number of blocks). A row is the largest unit every offset and length of
the window is a multiple of (a block, or a K or V half of one), read as 8-byte words where the
alignment allows. Copies between a device and host memory (staging) always go run by run: a
kernel cannot index host memory.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import NamedTuple

WINDOW_BYTES = 64 << 20  # bytes issued between two deadline and liveness checks
DIRECT_MAX_RUNS = 8  # up to this many runs, one copy_ each; above, one gather and one scatter
MIN_ROW_BYTES = 64  # rows smaller than this make index tensors larger than the data: copy run by run


class Window(NamedTuple):
    """Runs issued together: run i copies lengths[i] bytes from src_offsets[i] to dst_offsets[i]."""

    src_offsets: tuple[int, ...]
    dst_offsets: tuple[int, ...]
    lengths: tuple[int, ...]
    num_bytes: int


def plan_windows(copies: Iterable[tuple[int, int, int]], window_bytes: int = WINDOW_BYTES) -> list[Window]:
    """Cut (src_offset, dst_offset, length) runs into windows of at most `window_bytes`, in order;
    a run longer than a window is split across windows. Empty runs are dropped."""
    windows: list[Window] = []
    src: list[int] = []
    dst: list[int] = []
    lengths: list[int] = []
    filled = 0
    for src_offset, dst_offset, length in copies:
        done = 0
        while done < length:
            piece = min(length - done, window_bytes - filled)
            src.append(src_offset + done)
            dst.append(dst_offset + done)
            lengths.append(piece)
            filled += piece
            done += piece
            if filled == window_bytes:
                windows.append(Window(tuple(src), tuple(dst), tuple(lengths), filled))
                src, dst, lengths, filled = [], [], [], 0
    if lengths:
        windows.append(Window(tuple(src), tuple(dst), tuple(lengths), filled))
    return windows


def enqueue_window(src, dst, window: Window) -> list:
    """Issue `window`'s copies from byte tensor `src` to byte tensor `dst` on the current stream.
    Returns the temporaries the copies use, to be kept alive until they completed. Runs in
    inference mode: views of a KV storage made while vLLM registered it under
    `torch.inference_mode()` are inference tensors, which torch updates in place only there."""
    import torch  # lazy: heavy; this module imports without torch, only its tensor code needs it

    unit = math.gcd(*window.src_offsets, *window.dst_offsets, *window.lengths)
    with torch.inference_mode():
        if len(window.lengths) <= DIRECT_MAX_RUNS or src.device != dst.device or unit < MIN_ROW_BYTES:
            for src_offset, dst_offset, length in zip(window.src_offsets, window.dst_offsets, window.lengths):
                dst[dst_offset:dst_offset + length].copy_(src[src_offset:src_offset + length], non_blocking=True)
            return []
        return _gather_scatter(src, dst, window, unit)


def _gather_scatter(src, dst, window: Window, unit: int) -> list:
    import torch  # lazy: heavy; this module imports without torch, only its tensor code needs it

    width = next(w for w in (8, 4, 2, 1) if unit % w == 0 and src.data_ptr() % w == 0 and dst.data_ptr() % w == 0)
    word = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}[width]
    src_rows = src[:src.numel() // unit * unit].view(word).view(-1, unit // width)
    dst_rows = dst[:dst.numel() // unit * unit].view(word).view(-1, unit // width)
    src_index = row_indices(window.src_offsets, window.lengths, unit)
    dst_index = row_indices(window.dst_offsets, window.lengths, unit)
    keep = []
    if src.device.type != "cpu":  # indices go up from pinned memory, on this stream
        src_index, dst_index = src_index.pin_memory(), dst_index.pin_memory()
        keep += [src_index, dst_index]
        src_index, dst_index = src_index.to(src.device, non_blocking=True), dst_index.to(src.device, non_blocking=True)
    keep += [src_index, dst_index]
    gathered = src_rows.index_select(0, src_index)
    dst_rows.index_copy_(0, dst_index, gathered)
    keep.append(gathered)
    return keep


def row_indices(offsets: tuple[int, ...], lengths: tuple[int, ...], unit: int):
    """The row numbers (rows of `unit` bytes) that runs at `offsets` of `lengths` bytes cover, in
    order, as one int64 CPU tensor: built by tensor ops, without a loop over rows."""
    import torch  # lazy: heavy; this module imports without torch, only its tensor code needs it

    starts = torch.tensor(offsets, dtype=torch.int64) // unit
    counts = torch.tensor(lengths, dtype=torch.int64) // unit
    run_of_row = torch.repeat_interleave(torch.arange(len(counts)), counts)
    first_row_of_run = torch.cumsum(counts, 0) - counts
    return starts[run_of_row] + torch.arange(int(counts.sum())) - first_row_of_run[run_of_row]
