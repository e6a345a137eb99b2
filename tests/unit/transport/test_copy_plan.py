"""copy_plan: runs cut into windows, and a window's copies (run by run, or gathered) byte-exact."""

import random

import pytest
import torch

from pdserve.transport import copy_plan
from pdserve.transport.copy_plan import Window, enqueue_window, plan_windows, row_indices


def test_windows_hold_at_most_their_size_split_long_runs_and_keep_order():
    windows = plan_windows([(0, 100, 10), (50, 0, 0), (20, 200, 25), (60, 300, 5)], window_bytes=16)
    assert [w.num_bytes for w in windows] == [16, 16, 8]
    assert windows[0] == Window((0, 20), (100, 200), (10, 6), 16)
    assert windows[1] == Window((26,), (206,), (16,), 16)
    assert windows[2] == Window((42, 60), (222, 300), (3, 5), 8)
    assert plan_windows([]) == [] and plan_windows([(0, 0, 0)]) == []


def test_row_indices_cover_each_run_in_order():
    assert row_indices((0, 512, 128), (256, 128, 128), 128).tolist() == [0, 1, 4, 1]


def _reference(src: torch.Tensor, dst: torch.Tensor, window: Window) -> torch.Tensor:
    expected = dst.clone()
    for s, d, n in zip(window.src_offsets, window.dst_offsets, window.lengths):
        expected[d:d + n] = src[s:s + n]
    return expected


@pytest.mark.parametrize("num_runs, unit", [(3, 4096), (40, 4096), (40, 1024 + 512), (40, 32), (200, 8192)])
def test_a_window_lands_byte_exact_whichever_way_it_is_issued(num_runs, unit, monkeypatch):
    calls = []
    real = copy_plan._gather_scatter
    monkeypatch.setattr(copy_plan, "_gather_scatter", lambda *a: calls.append(a) or real(*a))
    rng = random.Random(num_runs * unit)
    num_slots = num_runs * 3
    src = torch.randint(0, 256, (num_slots * unit,), dtype=torch.uint8)
    dst = torch.zeros(num_slots * unit + 7, dtype=torch.uint8)
    src_slots, dst_slots = rng.sample(range(num_slots), num_runs), rng.sample(range(num_slots), num_runs)
    lengths = [unit] * num_runs
    window = Window(tuple(s * unit for s in src_slots), tuple(d * unit for d in dst_slots), tuple(lengths),
                    sum(lengths))
    expected = _reference(src, dst, window)
    assert enqueue_window(src, dst, window) is not None
    assert torch.equal(dst, expected)
    gathered = num_runs > copy_plan.DIRECT_MAX_RUNS and unit >= copy_plan.MIN_ROW_BYTES
    assert bool(calls) is gathered


def test_rows_are_read_as_narrower_words_when_an_address_is_not_aligned():
    base = torch.randint(0, 256, (64 * 100 + 1,), dtype=torch.uint8)
    src = base[1:]  # an odd address: rows of 64 bytes read byte by byte
    dst = torch.zeros(64 * 100, dtype=torch.uint8)
    window = Window(tuple(range(0, 64 * 40, 64)), tuple(range(64 * 99, 64 * 59, -64)), (64,) * 40, 64 * 40)
    expected = _reference(src, dst, window)
    enqueue_window(src, dst, window)
    assert torch.equal(dst, expected)
