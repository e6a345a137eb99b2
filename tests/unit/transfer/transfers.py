"""The specs and messages of one transfer `t1` between the harness's P and D, shared by the
engine tests: P's blocks, D's blocks, one prompt."""

from __future__ import annotations

import time

from pdserve.config import TransferMode
from pdserve.control.messages import ReadDone, RemoteBlocks, WriteDone
from pdserve.transfer.specs import HoldSpec, RecvSpec, SendSpec
from tests.unit.connector.harness import D_ADDRESS, NUM_LAYERS, P_ADDRESS, PROMPT_HASH, Instance

WRITE, READ = TransferMode.WRITE, TransferMode.READ
P_BLOCKS = (0, 1, 2, 3)
D_BLOCKS = (4, 5, 6, 7)


def write_recv(request_id="req-d", transfer_id="t1", blocks=D_BLOCKS, first_block=0,
               prompt_hash=PROMPT_HASH) -> RecvSpec:
    return RecvSpec(request_id, transfer_id, WRITE, P_ADDRESS, tuple(blocks), first_block, None, None, prompt_hash)


def read_recv(request_id="req-d", transfer_id="t1", blocks=D_BLOCKS, remote=P_BLOCKS, first_block=0,
              prompt_hash=PROMPT_HASH) -> RecvSpec:
    return RecvSpec(request_id, transfer_id, READ, P_ADDRESS, tuple(blocks), first_block, tuple(remote),
                    time.time() + 30, prompt_hash)


def send(p: Instance, request_id="req-p", transfer_id="t1", blocks=P_BLOCKS, prompt_hash=PROMPT_HASH,
         layers=range(NUM_LAYERS)) -> None:
    """P plans a WRITE send and the forward pass computes `layers`."""
    p.engine.begin_step()
    p.engine.add_send(SendSpec(request_id, transfer_id, D_ADDRESS, tuple(blocks), prompt_hash))
    for layer in layers:
        p.engine.layer_ready(layer)


def hold(p: Instance, request_id="req-p", transfer_id="t1", blocks=P_BLOCKS, prompt_hash=PROMPT_HASH,
         hold_s=30.0) -> None:
    p.engine.begin_step()
    p.engine.add_hold(HoldSpec(request_id, transfer_id, tuple(blocks), time.time() + hold_s, prompt_hash))


def remote_blocks(transfer_id="t1", blocks=D_BLOCKS, first_block=0, prompt_hash=PROMPT_HASH) -> RemoteBlocks:
    return RemoteBlocks(transfer_id, list(blocks), first_block, prompt_hash, 5.0)


def write_done(transfer_id="t1", ok=True, error="", prompt_hash=PROMPT_HASH) -> WriteDone:
    return WriteDone(transfer_id, ok, error, prompt_hash if ok else "")


def read_done(transfer_id="t1", blocks=P_BLOCKS, prompt_hash=PROMPT_HASH) -> ReadDone:
    return ReadDone(transfer_id, list(blocks), prompt_hash, D_ADDRESS.host, D_ADDRESS.notify_port)


def moved(src: dict, src_blocks, dst_before: dict, dst_blocks, first_block: int = 0) -> dict:
    """The destination snapshot expected after src_blocks[first_block:] landed in dst_blocks[first_block:]."""
    expected = dict(dst_before)
    for s, d in list(zip(src_blocks, dst_blocks))[first_block:]:
        for layer in range(NUM_LAYERS):
            expected[(layer, d)] = src[(layer, s)]
    return expected
