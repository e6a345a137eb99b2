"""The fingerprint check every handshake makes (handshake.py)."""

from __future__ import annotations

import pytest

from pdserve.connector.worker.handshake import check_compatible
from pdserve.errors import IncompatiblePeerError


def test_check_compatible_names_every_differing_field():
    ours = {"dtype": "bfloat16", "block_size": 16, "cpu_isa": "AVX512", "model": "m"}
    theirs = {"dtype": "float16", "block_size": 32, "cpu_isa": "AVX512", "extra": 1, "model": "m"}
    with pytest.raises(IncompatiblePeerError) as info:
        check_compatible(ours, theirs, "127.0.0.1:6301")
    message = str(info.value)
    for field in ("dtype", "block_size", "extra", "127.0.0.1:6301", "bfloat16", "float16"):
        assert field in message
    assert "cpu_isa" not in message and "model" not in message


def test_a_hybrid_models_tp_sizes_are_named_before_the_shapes_they_change():
    ours = {"kv_groups": ["state:[3, 512]"], "kv_layer_shapes": "a", "state_tensor_parallel_size": 1}
    theirs = {"kv_groups": ["state:[3, 256]"], "kv_layer_shapes": "b", "state_tensor_parallel_size": 2}
    with pytest.raises(IncompatiblePeerError, match=r"KV cache \(state_tensor_parallel_size: ours 1, theirs 2; kv_groups"):
        check_compatible(ours, theirs, "peer")


def test_check_compatible_accepts_equal_fingerprints():
    check_compatible({"a": 1, "b": [1, 2]}, {"b": [1, 2], "a": 1}, "peer")
