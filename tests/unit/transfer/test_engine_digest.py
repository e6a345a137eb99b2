"""kv_verify digest, two real engines: P digests what it sends, D checks what landed. A copy
corrupted where it lands (shared memory copy hook, a NIXL stand-in, a state block, a head slice
of a tensor-parallel rank pair) fails the transfer, is counted and never served; with the digest
off nothing is hashed and no digest travels."""

from __future__ import annotations

import ctypes
import logging

import pytest

from pdserve.config import TransferMode
from pdserve.control.messages import ReadAck, WriteDone
from pdserve.transfer.verify import REPORT_EVERY
from tests.unit.connector.harness import STATE_BYTES, Pair
from tests.unit.transfer.nixl_fakes import SlowNixl
from tests.unit.transfer.tp_harness import Cluster
from tests.unit.transfer.transfers import D_BLOCKS, P_BLOCKS, hold, read_recv, send, write_recv

WRITE, READ = TransferMode.WRITE, TransferMode.READ
MODES = [WRITE, READ]
DIGEST = {"kv_verify": "digest"}
HYBRID_P = (1, 2, 3, 0, 0, 5)  # test_engine_groups: attention blocks, then null, null, the state block
HYBRID_D = (4, 5, 6, 0, 0, 2)


def flip(ranges, only_length: int | None = None) -> None:
    """Invert the first byte of every landed range (of `only_length` bytes, if given)."""
    for address, length in ranges:
        if only_length is None or length == only_length:
            byte = ctypes.c_ubyte.from_address(address)
            byte.value ^= 0xFF


def corrupt_landing(pair: Pair, only_length: int | None = None) -> None:
    """Corrupt every copy where it lands: the copier is P in WRITE, D in READ."""
    copier = pair.p if pair.mode is WRITE else pair.d
    copier.transport.set_copy_hook(lambda direction, ranges: flip(ranges, only_length))


def transfer(pair: Pair, p_blocks=P_BLOCKS, d_blocks=D_BLOCKS, first_block=0, request="req-d") -> None:
    """One transfer of `request` (P's side named `request` + "-p"), pumped until D reported it."""
    tid = f"t-{request}"
    if pair.mode is WRITE:
        pair.d.engine.add_recv(write_recv(request_id=request, transfer_id=tid, blocks=d_blocks,
                                          first_block=first_block))
        pair.pump_until(lambda: pair.d.notifier.sent, sides=(pair.d,))
        send(pair.p, request_id=f"{request}-p", transfer_id=tid, blocks=p_blocks)
    else:
        hold(pair.p, request_id=f"{request}-p", transfer_id=tid, blocks=p_blocks)
        pair.p.finished_req_ids.add(f"{request}-p")
        pair.pump()
        pair.d.engine.add_recv(read_recv(request_id=request, transfer_id=tid, blocks=d_blocks, remote=p_blocks,
                                         first_block=first_block))
    pair.pump_until(lambda: request in pair.d.recving)


def digests_sent(pair: Pair) -> list[bytes]:
    kind = WriteDone if pair.mode is WRITE else ReadAck
    return [m.kv_digest for m in pair.p.notifier.messages(kind)]


@pytest.mark.parametrize("hybrid, first_block", [(False, 0), (False, 2), (True, 0), (True, 2)])
@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.value)
def test_digest_travels_and_matches_in_both_modes_with_state_groups(mode, hybrid, first_block):
    with Pair(mode, p_timeouts=DIGEST, d_timeouts=DIGEST, hybrid=hybrid) as pair:
        p_blocks, d_blocks = (HYBRID_P, HYBRID_D) if hybrid else (P_BLOCKS, D_BLOCKS)
        transfer(pair, p_blocks, d_blocks, first_block)
        assert not pair.d.failed_recving
        assert [len(d) for d in digests_sent(pair)] == [4 * len(p_blocks)]
        assert pair.d.engine.stats.digest_mismatches == []
        assert pair.p.engine.stats.digest_seconds > 0 and pair.d.engine.stats.digest_seconds > 0


@pytest.mark.parametrize("hybrid", [False, True], ids=["attention", "state-only"])
@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.value)
def test_a_corrupted_copy_is_caught_counted_and_not_served(mode, hybrid, caplog):
    with Pair(mode, p_timeouts=DIGEST, d_timeouts=DIGEST, hybrid=hybrid) as pair:
        corrupt_landing(pair, only_length=STATE_BYTES if hybrid else None)  # hybrid: the state block alone
        p_blocks, d_blocks = (HYBRID_P, HYBRID_D) if hybrid else (P_BLOCKS, D_BLOCKS)
        with caplog.at_level(logging.ERROR, logger="pdserve.connector"):
            transfer(pair, p_blocks, d_blocks)
        assert "req-d" in pair.d.failed_recving
        assert pair.d.engine.stats.digest_mismatches == [f"shm:{mode.value.lower()}"]
        assert pair.d.engine.stats.num_completed == 0
        state_position = len(d_blocks) - 1
        expected = f"decode blocks [{d_blocks[state_position]}]" if hybrid else f"decode blocks [{d_blocks[0]}"
        assert "KV digest mismatch" in caplog.text and expected in caplog.text and "127.0.0.1:6301/p" in caplog.text


class CorruptingNixl(SlowNixl):
    """The NIXL stand-in whose requests land their bytes, then flip the first of each landed range."""

    def __init__(self, name: str):
        super().__init__(name)
        self.name = "nixl"
        agent, end_all = self.agent, self.agent.end_all

        def end_all_corrupted() -> None:
            landed = []
            for request in agent.running():
                write, local, remote = agent.requests[request]
                landed += [(r[0] if write else l[0], l[1]) for l, r in zip(local, remote)]
            end_all()
            flip(landed)

        agent.end_all = end_all_corrupted


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.value)
def test_a_copy_corrupted_by_nixl_is_caught(mode):
    with Pair(mode, p_timeouts=DIGEST, d_timeouts=DIGEST, transport_factory=CorruptingNixl) as pair:
        copier = pair.p if mode is WRITE else pair.d
        if mode is WRITE:
            pair.d.engine.add_recv(write_recv())
            pair.pump_until(lambda: pair.d.notifier.sent, sides=(pair.d,))
            send(pair.p, request_id="req-d-p", transfer_id="t1")
        else:
            hold(pair.p, request_id="req-d-p", transfer_id="t1")
            pair.pump()
            pair.d.engine.add_recv(read_recv())
        pair.pump_until(lambda: copier.transport.agent.running())
        copier.transport.agent.end_all()
        pair.pump_until(lambda: "req-d" in pair.d.recving)
        assert "req-d" in pair.d.failed_recving
        assert pair.d.engine.stats.digest_mismatches == [f"nixl:{mode.value.lower()}"]


@pytest.mark.parametrize("p_size, d_size, heads", [(2, 1, 2), (1, 2, 2), (2, 1, 1)], ids=["2to1", "1to2", "latent"])
@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.value)
def test_each_d_rank_checks_the_heads_it_received(mode, p_size, d_size, heads):
    """Rank pairs move head slices (or, with one KV head, an MLA-like latent every rank holds
    whole); each D rank checks its own. The first copy of each transfer is corrupted: every
    D rank it reached fails, and the healthy transfer before it passed on every rank."""
    with Cluster(mode, p_size, d_size, heads) as cluster:
        start = cluster.hold if mode is READ else cluster.send
        cluster.recv()
        start()
        cluster.finish()
        cluster.pump_until(lambda: all("req-d" in d.recving for d in cluster.d))
        assert [d.failed_recving for d in cluster.d] == [[]] * d_size
        copiers = cluster.p if mode is WRITE else cluster.d
        for rank in copiers:
            rank.transport.set_copy_hook(lambda direction, ranges: flip(ranges))
        cluster.recv(request_id="req-d2", transfer_id="t2")
        start(request_id="req-p2", transfer_id="t2")
        cluster.finish("req-p2")
        cluster.pump_until(lambda: all("req-d2" in d.recving for d in cluster.d))
        assert [d.failed_recving for d in cluster.d] == [["req-d2"]] * d_size
        assert all(d.engine.stats.digest_mismatches == [f"shm:{mode.value.lower()}"] * len(d.engine.stats.digest_mismatches)
                   and d.engine.stats.digest_mismatches for d in cluster.d)


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.value)
def test_digest_off_hashes_nothing_and_sends_no_digest(mode):
    with Pair(mode) as pair:  # the harness's default: off
        transfer(pair)
        assert not pair.d.failed_recving
        assert digests_sent(pair) == [b""]
        assert pair.p.engine.stats.digest_seconds == 0 and pair.d.engine.stats.digest_seconds == 0


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.value)
def test_digest_off_serves_a_corrupted_copy(mode):
    """What the digest adds: without it, corrupted bytes are delivered as a success."""
    with Pair(mode) as pair:
        corrupt_landing(pair)
        transfer(pair)
        assert not pair.d.failed_recving and pair.d.engine.stats.digest_mismatches == []


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.value)
def test_decode_verifying_refuses_kv_sent_without_a_digest(mode, caplog):
    with Pair(mode, d_timeouts=DIGEST) as pair:
        with caplog.at_level(logging.ERROR, logger="pdserve.connector"):
            transfer(pair)
        assert "req-d" in pair.d.failed_recving
        assert "kv_verify differs" in caplog.text
        assert pair.d.engine.stats.digest_mismatches == []


def test_a_prefill_that_keeps_sending_bad_kv_is_reported(caplog):
    with Pair(WRITE, p_timeouts=DIGEST, d_timeouts=DIGEST) as pair:
        corrupt_landing(pair)
        with caplog.at_level(logging.ERROR, logger="pdserve.connector"):
            for n in range(REPORT_EVERY):
                transfer(pair, request=f"req-{n}")
        assert len(pair.d.engine.stats.digest_mismatches) == REPORT_EVERY
        assert f"has sent KV that failed its digest in {REPORT_EVERY} transfers" in caplog.text
