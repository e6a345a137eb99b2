import multiprocessing as mp
import os

import pytest
import torch

from pdserve.transport import segment_name
from pdserve.transport.shared_segment import SHM_DIR
from pdserve.transport.shm_tensor import (
    move_tensor_to_shared_memory,
    move_tensors_to_shared_memory,
    tensor_byte_offset,
)
from tests.unit.transport import peer

NUM_BLOCKS, NUM_KV_HEADS, BLOCK_SIZE, HEAD_SIZE = 8, 2, 16, 32


def _vllm_like_kv_caches(num_layers=2):
    """Like vLLM 0.32 on CPU: one raw int8 buffer, a bf16 per-layer view, under inference_mode."""
    layer_bytes = NUM_BLOCKS * NUM_KV_HEADS * BLOCK_SIZE * 2 * HEAD_SIZE * 2
    with torch.inference_mode():
        raw = torch.zeros(num_layers * layer_bytes, dtype=torch.int8)
        layers = {
            f"layer.{i}": raw[i * layer_bytes : (i + 1) * layer_bytes]
            .view(torch.bfloat16)
            .view(NUM_BLOCKS, NUM_KV_HEADS, BLOCK_SIZE, 2 * HEAD_SIZE)
            for i in range(num_layers)
        }
        for i, kv in enumerate(layers.values()):
            kv.copy_(torch.arange(kv.numel(), dtype=torch.float32).view_as(kv) % 251 + i)
    return raw, layers


def _bytes_of(tensor):
    return tensor.contiguous().view(torch.uint8).flatten().numpy().tobytes()


def test_moving_a_view_moves_the_storage_and_every_view_follows():
    raw, layers = _vllm_like_kv_caches()
    kv = layers["layer.1"]
    kernel_view = kv.view(NUM_BLOCKS * 2, NUM_KV_HEADS, BLOCK_SIZE // 2, 2 * HEAD_SIZE)  # a sibling view
    before = _bytes_of(kv)
    alias = kv  # another reference to the same tensor object
    segment = move_tensor_to_shared_memory(kv, segment_name("tensortest", "view"))
    try:
        assert segment.size == raw.untyped_storage().nbytes()
        for t in (raw, kv, kernel_view, layers["layer.0"]):
            assert segment.address <= t.data_ptr() < segment.address + segment.size
        offset = tensor_byte_offset(kv, segment)
        assert offset == raw.numel() // 2
        assert _bytes_of(alias) == before, "contents survive the move"
        assert kv.is_inference() and kv.dtype == torch.bfloat16 and kv.shape == (8, 2, 16, 64)
        with torch.inference_mode():
            kernel_view[3, 1, 2, 5] = 42.0
        assert kv[1, 1, 10, 5].item() == 42.0
        mapped = torch.frombuffer(segment.mmap, dtype=torch.uint8)[offset:].view(torch.bfloat16)
        assert mapped[: kv.numel()].view_as(kv)[1, 1, 10, 5].item() == 42.0
    finally:
        segment.close()
    assert not os.path.exists(os.path.join(SHM_DIR, segment.name))
    assert kv[1, 1, 10, 5].item() == 42.0, "the mapping outlives the unlinked name while tensors use it"


def test_other_process_sees_tensor_writes_and_tensor_sees_its_writes():
    _, layers = _vllm_like_kv_caches()
    kv = layers["layer.0"]
    segment = move_tensor_to_shared_memory(kv, segment_name("tensortest", "xproc"))
    ctx = mp.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    proc = ctx.Process(target=peer.tensor_peer, args=(child_conn, segment.name), daemon=True)
    try:
        with torch.inference_mode():
            kv[2].fill_(3.5)
        proc.start()
        assert conn.poll(60), "peer process did not answer"
        seen = conn.recv()
        offset = tensor_byte_offset(kv, segment)
        assert seen[offset : offset + kv.numel() * 2] == _bytes_of(kv)

        block = kv[5]
        value = torch.full_like(block, -1.25)
        block_offset = offset + 5 * block.numel() * 2
        conn.send((block_offset, _bytes_of(value)))
        assert conn.recv() == "written"
        assert torch.equal(kv[5], value)
        proc.join(10)
        assert proc.exitcode == 0
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join(5)
        segment.close()


def test_move_tensors_shares_one_segment_per_storage():
    raw, layers = _vllm_like_kv_caches(num_layers=3)
    with torch.inference_mode():
        separate = torch.ones(NUM_BLOCKS, 4, dtype=torch.bfloat16)
    placements = move_tensors_to_shared_memory({**layers, "other": separate}, "tensortest")
    segments = {p.segment.name: p.segment for p in placements.values()}
    try:
        assert len(segments) == 2
        first = placements["layer.0"].segment
        assert all(placements[name].segment is first for name in layers)
        assert [placements[name].byte_offset for name in layers] == [0, raw.numel() // 3, 2 * raw.numel() // 3]
        assert placements["other"].byte_offset == 0 and placements["other"].segment is not first
        assert separate.sum().item() == NUM_BLOCKS * 4
    finally:
        for segment in segments.values():
            segment.close()


def test_set_in_place_fallback_requires_inference_mode_for_inference_tensors():
    """Documents torch 2.13: set_ on an inference tensor only works inside inference_mode."""
    _, layers = _vllm_like_kv_caches(num_layers=1)
    kv = layers["layer.0"]
    target = torch.zeros(kv.untyped_storage().nbytes(), dtype=torch.uint8).untyped_storage()
    with pytest.raises(RuntimeError, match="Inplace update to inference tensor"):
        kv.set_(target, 0, kv.size(), kv.stride())
    with torch.inference_mode():
        kv.set_(target, 0, kv.size(), kv.stride())
    assert kv.data_ptr() == target.data_ptr()


def test_existing_segment_name_is_refused():
    from pdserve.errors import TransferError

    with pytest.raises(TransferError, match="already exists"):
        t = torch.zeros(16)
        first = move_tensor_to_shared_memory(t, segment_name("tensortest", "dup"))
        try:
            move_tensor_to_shared_memory(torch.zeros(16), first.name)
        finally:
            first.close()
