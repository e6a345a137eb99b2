"""TransferEngine with two KV cache groups as vLLM keeps a hybrid (Gated DeltaNet) model: an
attention group whose run names a block per token range, and a state group whose run is vLLM's
null block but for the last entry, the block holding the request's state (kv_groups.py). Both
modes, real bytes through ShmTransport: the attention blocks move, the state block's state moves
without its page's padding, and nothing else of D changes."""

from __future__ import annotations

import pytest

from pdserve.config import TransferMode
from tests.unit.connector.harness import BLOCK_BYTES, STATE_BYTES, Pair
from tests.unit.transfer.transfers import hold, read_done, read_recv, send, write_recv

# one prompt of 3 blocks: group 0 (layer 0) its attention blocks, group 1 (layer 1) null, null, state
P_BLOCKS = (1, 2, 3, 0, 0, 5)
D_BLOCKS = (4, 5, 6, 0, 0, 2)


def expected_d(p_before: dict, d_before: dict, first_block: int) -> dict:
    expected = dict(d_before)
    for p, d in list(zip(P_BLOCKS[:3], D_BLOCKS[:3]))[first_block:]:
        expected[(0, d)] = p_before[(0, p)]
    # the state: its bytes, not the page's padding
    expected[(1, 2)] = p_before[(1, 5)][:STATE_BYTES] + d_before[(1, 2)][STATE_BYTES:]
    return expected


@pytest.mark.parametrize("first_block", [0, 2])
@pytest.mark.parametrize("mode", [TransferMode.WRITE, TransferMode.READ])
def test_each_group_moves_its_own_blocks_and_the_state_without_padding(mode, first_block):
    with Pair(mode, hybrid=True) as pair:
        p_before, d_before = pair.p.snapshot(), pair.d.snapshot()
        if mode is TransferMode.WRITE:
            pair.d.engine.add_recv(write_recv(blocks=D_BLOCKS, first_block=first_block))
            pair.pump_until(lambda: pair.d.notifier.sent, sides=(pair.d,))
            send(pair.p, blocks=P_BLOCKS)
            pair.pump_until(lambda: "req-d" in pair.d.recving)
        else:
            hold(pair.p, blocks=P_BLOCKS)
            pair.p.finished_req_ids.add("req-p")
            pair.pump()
            pair.d.engine.add_recv(read_recv(blocks=D_BLOCKS, remote=P_BLOCKS, first_block=first_block))
            pair.pump_until(lambda: "req-d" in pair.d.recving and "req-p" in pair.p.sending)
            assert [s.message for s in pair.d.notifier.sent] == [read_done(blocks=P_BLOCKS)]
        assert not pair.d.failed_recving
        after = pair.d.snapshot()
        expected = expected_d(p_before, d_before, first_block)
        for key in sorted(expected):
            assert after[key] == expected[key], f"layer, block {key}"
        assert pair.p.snapshot() == p_before
        assert pair.d.engine.stats.transfer_bytes == [(3 - first_block) * BLOCK_BYTES + STATE_BYTES]


def test_a_state_block_p_does_not_hold_fails_the_transfer_and_moves_nothing():
    with Pair(TransferMode.READ, hybrid=True) as pair:
        d_before = pair.d.snapshot()
        hold(pair.p, blocks=(1, 2, 3, 0, 0, 0))  # P names no state block
        pair.p.finished_req_ids.add("req-p")
        pair.pump()
        pair.d.engine.add_recv(read_recv(blocks=D_BLOCKS, remote=(1, 2, 3, 0, 0, 0)))
        pair.pump_until(lambda: "req-d" in pair.d.failed_recving)
        assert pair.d.snapshot() == d_before
