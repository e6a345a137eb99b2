"""Every control-plane socket's frame bound fits the largest legitimate message it receives, built at
the limits the messages validate, and not much more (control/limits.py); ZMQ drops a connection that
sends a frame above a socket's bound before buffering it; queues are sized to their traffic."""

from __future__ import annotations

import os
import time

import pytest
import zmq

import pdserve.placement.messages  # noqa: F401 - the placement messages a notify server receives
from pdserve.control import limits
from pdserve.control.codec import MAC_BYTES, Codec
from pdserve.control.endpoint import Client, Server
from pdserve.control.messages import (
    MAX_BLOCK_ID,
    MAX_BLOCKS,
    MAX_IDENTITY,
    MAX_LAYERS,
    MESSAGE_TYPES,
    ClockSkew,
    HandshakeReply,
    HandshakeRequest,
    ReadAck,
    ReadDone,
    RemoteBlocks,
    WriteDone,
)
from pdserve.control.registration import Registration
from pdserve.errors import ProtocolError
from tests.unit.control.samples import example

SECRET = b"s" * 32
LONGEST_ID = "i" * MAX_IDENTITY
HOST = "h" * 253
NIXL_METADATA = 256 * 1024
CUDA_IPC_FIELDS = ["cuda:7", os.urandom(64).hex(), 1 << 40, 1 << 40, os.urandom(64).hex(), 1 << 40,
                   os.urandom(64).hex(), True]


def codec() -> Codec:
    return Codec(SECRET, LONGEST_ID)


def fingerprint() -> dict:
    return {"model": "m" * 256, "block_size": 16, "dtype": "bfloat16", "tp": [7, 8, 128], "kv_dtype": "torch.bfloat16",
            "kv_head_shape": [16, 8, 128], "kv_layers": "a" * 16, "kv_layer_shapes": "b" * 16,
            "kv_regions": list(range(MAX_LAYERS)), "kv_groups": ["full_attention:16", "sliding_window:16:4096"],
            "kv_device": "cuda:7", "kv_block_format": "x" * 64}


def largest_handshake_reply() -> HandshakeReply:
    regions = [{"region_id": i, "size": 1 << 40, "shm_name": f"pdserve-{1 << 22}-{'f' * 8}-kv{i}", "address": (1 << 47) + i,
                "device": "cuda:7", "ipc": ["cuda", (1 << 31) - 1, 1 << 40, CUDA_IPC_FIELDS]} for i in range(MAX_LAYERS)]
    layers = [[i, 1 << 47, 1 << 30, 1 << 20] for i in range(MAX_LAYERS)]
    return HandshakeReply(LONGEST_ID, fingerprint(), regions, layers, (1 << 32) - 1, (1 << 62) - 1, "b" * 36,
                          os.urandom(NIXL_METADATA), "/proc/4294967/fd/123456789", "ab" * 32)


def largest_request_messages() -> list:
    block_ids = [MAX_BLOCK_ID - 1] * MAX_BLOCKS
    digest = b"\xff" * (4 * MAX_BLOCKS)  # a CRC-32 per block
    return [RemoteBlocks("t" * 256, block_ids, 0, "a" * 32, 3600.0),
            ReadDone("t" * 256, block_ids, "a" * 32, HOST, 65535),
            WriteDone("t" * 256, True, "e" * 4096, "a" * 32, digest),
            ReadAck("t" * 256, True, "e" * 4096, digest),
            HandshakeRequest(LONGEST_ID, fingerprint(), "/proc/4294967/fd/123456789", "ab" * 32)]


def largest_registration() -> Registration:
    return Registration("P", f"{HOST}:65535", f"host:{HOST},handshake:65535,notify:65535", "WRITE", 1024, 1024)


def size(msg) -> int:
    return len(codec().encode(msg, LONGEST_ID))


@pytest.mark.parametrize("name, largest, bound", [
    ("handshake reply", lambda: [largest_handshake_reply()], limits.MAX_FRAME_BYTES),
    ("server requests", largest_request_messages, limits.MAX_REQUEST_FRAME_BYTES),
    ("registration", lambda: [largest_registration()], limits.MAX_REGISTRATION_FRAME_BYTES),
    ("clock-skew notice", lambda: [ClockSkew(-1e300)], limits.MAX_NOTICE_FRAME_BYTES),
])
def test_each_bound_fits_the_largest_legitimate_message_and_not_twice_more(name, largest, bound):
    measured = max(size(msg) for msg in largest())
    assert measured <= bound, f"the largest {name} is {measured} bytes, above its bound {bound}"
    assert bound < 2 * measured, f"the bound for {name} ({bound}) is more than twice its largest message ({measured})"


def test_messages_beyond_the_validated_limits_are_refused_before_any_bound():
    with pytest.raises(ProtocolError, match="block ids"):
        RemoteBlocks("t", [MAX_BLOCK_ID], 0, "a" * 32, 1.0).validate()
    with pytest.raises(ProtocolError, match=f"max {MAX_BLOCKS}"):
        RemoteBlocks("t", [0] * (MAX_BLOCKS + 1), 0, "a" * 32, 1.0).validate()
    reply = largest_handshake_reply()
    with pytest.raises(ProtocolError, match=f"max {MAX_LAYERS} each"):
        HandshakeReply(**{**reply.__dict__, "layers": reply.layers * 2}).validate()


def test_every_message_type_a_server_receives_fits_its_bound_at_its_sample_values():
    for cls in MESSAGE_TYPES.values():
        if cls is not HandshakeReply:
            assert size(example(cls)) <= limits.MAX_REQUEST_FRAME_BYTES, cls.TAG


def _dropped_unread(port: int, frame_bytes: int) -> bool:
    """Whether the peer at `port` drops our connection (ZMQ's MAXMSGSIZE) when we send `frame_bytes`."""
    context = zmq.Context()
    raw = context.socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    monitor = raw.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    try:
        raw.connect(f"tcp://127.0.0.1:{port}")
        raw.send(b"\0" * frame_bytes)
        return bool(monitor.poll(1500, zmq.POLLIN))
    finally:
        raw.disable_monitor()
        monitor.close(0)
        raw.close(0)
        context.term()


@pytest.mark.parametrize("bound", [limits.MAX_REQUEST_FRAME_BYTES, limits.MAX_REGISTRATION_FRAME_BYTES])
def test_a_server_drops_a_frame_one_byte_above_its_bound_and_reads_one_at_it(bound):
    with Server("127.0.0.1", 0, codec(), lambda envelope: None, max_frame_bytes=bound) as server:
        assert _dropped_unread(server.port, bound + 1)
        assert not _dropped_unread(server.port, bound)
        deadline = time.monotonic() + 5
        while server.num_rejected < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert server.num_rejected == 1  # read, and refused by the codec (no MAC)


def test_queues_are_sized_to_their_traffic():
    with Server("127.0.0.1", 0, codec(), lambda envelope: None) as server:
        assert server._socket.getsockopt(zmq.RCVHWM) == limits.SERVER_RECEIVE_QUEUE
        assert server._socket.getsockopt(zmq.SNDHWM) == limits.SERVER_REPLY_QUEUE
        assert server._socket.getsockopt(zmq.MAXMSGSIZE) == limits.MAX_REQUEST_FRAME_BYTES
        with Client(codec()) as client:
            client.send("127.0.0.1", server.port, example(ClockSkew), LONGEST_ID)
            (cached,) = client._senders.values()
            assert cached.socket.getsockopt(zmq.SNDHWM) == limits.SEND_QUEUE
            assert cached.socket.getsockopt(zmq.RCVHWM) == limits.NOTICE_QUEUE
            assert cached.socket.getsockopt(zmq.MAXMSGSIZE) == limits.MAX_NOTICE_FRAME_BYTES
    assert MAC_BYTES < limits.MAX_NOTICE_FRAME_BYTES <= limits.MAX_REGISTRATION_FRAME_BYTES
