"""Valid sample messages of every type, built from one sample value per field name.

Every registered type: the control plane's own and those a package above it registers with the
codec (placement's load and status, imported here so the registry holds them)."""

from __future__ import annotations

import pdserve.placement.messages  # noqa: F401
from pdserve.control.messages import field_types

SAMPLES = {
    "engine_id": "engine-p",
    "fingerprint": {"model": "m", "block_size": 16, "dtype": "bfloat16"},
    "regions": [{"region_id": 0, "size": 4096, "shm_name": "pdserve-1-x-kv0", "address": None}],
    "layers": [[0, 0, 256, 16], [0, 4096, 256, 16]],
    "pid": 4242,
    "start_time": 123456,
    "boot_id": "0c3b9a3e-5b5e-4b8e-9d1f-5d0b8f1e2a77",
    "nixl_metadata": b"nixl-agent-metadata",
    "kv_digest": b"\x01\x02\x03\x04" * 3,
    "host_proof": "/proc/4242/fd/7",
    "host_proof_digest": "ab" * 32,
    "reason": "block size differs: 16 vs 32",
    "transfer_id": "tx-1",
    "block_ids": [4, 5, 9],
    "first_block": 0,
    "prompt_hash": "0123456789abcdef0123456789abcdef",
    "write_for": 5.0,
    "ok": True,
    "error": "",
    "reply_host": "127.0.0.1",
    "reply_notify_port": 6401,
    "prefill_host": "127.0.0.1",
    "prefill_handshake_port": 6301,
    "queued_tokens": 1024,
    "per_token_s": 0.0005,
    "overhead_s": 0.008,
    "budget": 512,
    "at": 1.0,
    "decode_host": "127.0.0.1",
    "decode_handshake_port": 6302,
    "running_decodes": 3,
    "local_backlog_tokens": 256,
    "chunk": 512,
    "knows_prefill": True,
    "stream_tokens": 128.0,
    "per_decode_s": 0.001,
    "recent_itl_s": 0.02,
    "now_itl_s": 0.03,
    "chunk_headroom": 0.7,
    "prefill_share": 0.4,
    "decodes": 2,
    "counted_transfers": ["xfer-1", "xfer-2"],
    "prefill_token_s": 0.0006,
    "placed_local": {"127.0.0.1:6301": 7},
    "type": "P",
    "http_address": "127.0.0.1:8100",
    "zmq_address": "host:127.0.0.1,handshake:6301,notify:6401",
    "transfer_mode": "WRITE",
    "tp_size": 1,
    "dp_size": 1,
    "offset_s": 42.5,
}


def example(cls, **overrides):
    values = {}
    for name in field_types(cls):
        assert name in SAMPLES or name in overrides, f"add a sample value for {cls.__name__}.{name}"
        values[name] = overrides.get(name, SAMPLES.get(name))
    return cls(**values)
