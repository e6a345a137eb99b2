"""Transfers between P and D instances of different tensor-parallel sizes: every rank runs its own
TransferEngine and moves only the heads its rank pairs share (ranks.py, fanout.py)."""

from __future__ import annotations

import pytest

from pdserve.control.messages import ReadDone, Release, RemoteBlocks
from pdserve.transfer.specs import CancelSpec
from tests.unit.transfer.tp_harness import D_BASE, P_BASE, READ, WRITE, Cluster

MODES = [WRITE, READ]
# (P TP size, D TP size, model KV heads)
LAYOUTS = [(2, 1, 2), (1, 2, 2), (2, 2, 2), (4, 2, 4), (4, 1, 2), (1, 4, 2)]


def start(cluster: Cluster, first_block: int = 0) -> None:
    """The same specs to every rank of each instance, as vLLM gives them; vLLM finished P's request."""
    if cluster.mode is WRITE:
        cluster.recv(first_block=first_block)
        cluster.send()
    else:
        cluster.hold()
        cluster.recv(first_block=first_block)
    cluster.finish()


def everyone_reported(cluster: Cluster) -> bool:
    return all(r.sending for r in cluster.p) and all(r.recving for r in cluster.d)


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.value)
@pytest.mark.parametrize("p_size,d_size,heads", LAYOUTS, ids=lambda v: str(v))
def test_every_d_rank_gets_exactly_its_heads_and_every_rank_reports_once(mode, p_size, d_size, heads):
    with Cluster(mode, p_size, d_size, heads) as cluster:
        d_before = [d.snapshot() for d in cluster.d]
        p_before = [p.snapshot() for p in cluster.p]
        start(cluster)
        cluster.pump_until(lambda: everyone_reported(cluster))
        cluster.pump_for(0.05)  # nothing more may be reported
        for d, before in zip(cluster.d, d_before):
            expected = cluster.expected(d, before)
            for key, data in d.snapshot().items():
                assert data == expected[key], f"{d.name} layer {key[0]} block {key[1]}"
        assert [p.snapshot() for p in cluster.p] == p_before
        assert [(d.recving, d.failed_recving) for d in cluster.d] == [(["req-d"], [])] * d_size
        assert [p.sending for p in cluster.p] == [["req-p"]] * p_size
        assert [r.name for r in cluster.ranks if r.engine.has_active()] == []


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.value)
def test_only_the_blocks_from_first_block_on_move(mode):
    with Cluster(mode, 2, 1, 2) as cluster:
        [d] = cluster.d
        before = d.snapshot()
        start(cluster, first_block=2)
        cluster.pump_until(lambda: everyone_reported(cluster))
        assert d.snapshot() == cluster.expected(d, before, first_block=2)
        assert d.snapshot() != cluster.expected(d, before, first_block=0)
        assert d.failed_recving == []


def test_p_hold_is_freed_only_once_every_d_rank_reading_it_is_done():
    with Cluster(READ, 1, 2, 2) as cluster:
        [p], (d0, d1) = cluster.p, cluster.d
        cluster.hold()
        cluster.finish()
        cluster.recv(ranks=[d0])
        cluster.pump_until(lambda: d0.recving, ranks=[p, d0])
        cluster.pump_for(0.1, ranks=[p, d0])
        assert (d0.failed_recving, p.sending) == ([], []), "P freed the blocks D rank 1 has still to read"
        assert p.engine.has_active()
        cluster.recv(ranks=[d1])
        cluster.pump_until(lambda: d1.recving and p.sending)
        assert (d1.failed_recving, p.sending) == ([], ["req-p"])
        assert not p.engine.has_active()


def test_a_replica_no_d_rank_reads_frees_its_hold_at_once():
    """H=2 over P TP4: ranks 0 and 2 are read, ranks 1 and 3 hold copies nobody needs; D's one
    rank tells them to let go, long before their hold expires."""
    with Cluster(READ, 4, 1, 2) as cluster:
        [d] = cluster.d
        cluster.hold(hold_s=30.0)
        cluster.finish()
        cluster.recv()
        elapsed = cluster.pump_until(lambda: all(p.sending for p in cluster.p))
        assert elapsed < 1.0, f"the unread replicas held their blocks {elapsed:.1f} s"
        releases = [(s.address.notify_port, s.message.transfer_id) for s in d.notifier.delivered
                    if isinstance(s.message, Release)]
        assert releases == [(6602, "t1#1/4>0/1"), (6604, "t1#3/4>0/1")]
        reads = sorted(s.message.transfer_id for s in d.notifier.delivered if isinstance(s.message, ReadDone))
        assert reads == ["t1#0/4>0/1", "t1#2/4>0/1"]
        assert (d.recving, d.failed_recving) == (["req-d"], [])
        assert [p.name for p in cluster.p if p.engine.has_active()] == []


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.value)
def test_a_p_rank_refusing_fails_only_the_d_rank_that_pairs_with_it(mode):
    """P TP2 -> D TP2: P rank 1 refuses D's handshake (incompatible). D rank 1 fails the request,
    D rank 0 gets its heads, and P rank 1 still frees its blocks at once (D's Release reaches it)."""
    with Cluster(mode, 2, 2, 2) as cluster:
        (p0, p1), (d0, d1) = cluster.p, cluster.d
        p1.handshake_error, p1.refuses = f"{p1.identity} has an incompatible KV cache (block_size)", True
        d0_before = d0.snapshot()
        start(cluster)
        elapsed = cluster.pump_until(lambda: everyone_reported(cluster))
        assert elapsed < 1.0, f"took {elapsed:.1f} s: somebody waited for a deadline"
        assert (d0.recving, d0.failed_recving) == (["req-d"], [])
        assert (d1.recving, d1.failed_recving) == (["req-d"], ["req-d"])
        assert d0.snapshot() == cluster.expected(d0, d0_before)
        assert (p0.sending, p1.sending) == (["req-p"], ["req-p"])
        assert [r.name for r in cluster.ranks if r.engine.has_active()] == []


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.value)
def test_a_p_rank_not_answering_fails_the_request_and_nothing_outlives_the_deadlines(mode):
    """P TP2 -> D TP1: P rank 1 never answers D's handshake. D's one rank fails the request at
    once; P rank 1 (never told) frees its blocks at its own deadline."""
    with Cluster(mode, 2, 1, 2, p_timeouts={"defer_timeout": 0.5}) as cluster:
        p0, p1 = cluster.p
        [d] = cluster.d
        p1.handshake_error = f"no reply from {p1.address.host}:{p1.address.handshake_port} within 10 s"
        d_before = d.snapshot()
        if mode is WRITE:
            cluster.recv()
            cluster.send()
        else:
            cluster.hold(hold_s=0.5)
            cluster.recv()
        cluster.finish()
        cluster.pump_until(lambda: d.recving, timeout_s=1.0)
        assert d.failed_recving == ["req-d"]
        cluster.pump_until(lambda: all(p.sending for p in cluster.p), timeout_s=1.5)
        assert (p0.sending, p1.sending) == (["req-p"], ["req-p"])
        assert [r.name for r in cluster.ranks if r.engine.has_active()] == []
        if mode is READ:
            assert d.snapshot() != d_before, "the heads of P rank 0 were read"


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.value)
@pytest.mark.parametrize("parked", [True, False], ids=["while_parked", "after_split"])
def test_duplicate_transfer_id_on_d_fails_the_second_and_leaves_the_first_alone(mode, parked):
    with Cluster(mode, 1, 2, 2) as cluster:
        if mode is READ:
            cluster.hold()
        cluster.recv("req-a")
        if not parked:  # P's size is known: the first is split into its sub-transfers already
            cluster.pump_until(lambda: all(d.engine.running() for d in cluster.d), ranks=cluster.d)
        cluster.recv("req-b")
        if mode is WRITE:
            cluster.send()
        cluster.finish()
        cluster.pump_until(lambda: everyone_reported(cluster) and all(len(d.recving) == 2 for d in cluster.d))
        for d in cluster.d:
            assert sorted(d.recving) == ["req-a", "req-b"] and d.failed_recving == ["req-b"], d.name
        [p] = cluster.p
        assert p.sending == ["req-p"]
        kind = RemoteBlocks if mode is WRITE else ReadDone
        assert sorted(s.message.transfer_id for d in cluster.d for s in d.notifier.sent
                      if isinstance(s.message, kind)) == ["t1#0/1>0/2", "t1#0/1>1/2"]
        assert not any(isinstance(s.message, Release) for d in cluster.d for s in d.notifier.sent), \
            "the duplicate must not release the first one's blocks"


# ---- known bugs: these fail until pdserve is fixed (see each docstring) -----------------------


@pytest.mark.parametrize("mode,sizes", [(READ, (1, 1, 1)), (WRITE, (1, 1, 1)),  # controls: these pass
                                        (READ, (2, 1, 2)), (WRITE, (2, 1, 2)), (WRITE, (1, 2, 2))],
                         ids=lambda v: getattr(v, "value", str(v)))
def test_d_letting_go_before_it_receives_frees_every_p_rank_at_once(mode, sizes):
    """D prefills the prompt itself (or the request ended) before it received: every D rank gets
    the CancelSpec and P must let go at once, as it does between TP 1 instances. Bug: the engine
    runs no transfer of that id, so records.cancel sends one Release under the plain transfer id
    to P's rank-0 address only; P ranks >= 1 never hear of it, and a P rank whose send is split
    into sub-transfers (`t1#p/Tp>d/Td`) does not map the plain id onto them: they keep the
    prompt's blocks until their hold expires (READ) or defer_timeout (WRITE, 5 s here)."""
    with Cluster(mode, *sizes) as cluster:
        if mode is READ:
            cluster.hold()
        else:
            cluster.send()
        cluster.finish()
        for d in cluster.d:
            d.engine.cancel(CancelSpec("t1", P_BASE, "decode computes this prompt itself"))
        # at once: well inside defer_timeout (5 s here), the time P would otherwise keep the blocks
        cluster.pump_until(lambda: all(p.sending for p in cluster.p), timeout_s=3.0)
        assert [p.name for p in cluster.p if p.engine.has_active()] == []


@pytest.mark.parametrize("sizes", [(1, 1, 1), (1, 2, 2), (2, 1, 2)], ids=str)  # (1, 1, 1): a control that passes
def test_p_giving_up_before_it_sends_fails_every_d_rank_at_once(sizes):
    """WRITE: P's request ended before its KV was complete (its send never started): D must learn
    at once and reuse its blocks, as it does between TP 1 instances. Bug, the mirror of the one
    above: records.cancel sends one WriteDone(ok=False) under the plain transfer id to D's rank-0
    address; D's ranks wait under sub-transfer ids and keep their blocks until transfer_timeout
    (5 s here, 30 s by default)."""
    with Cluster(WRITE, *sizes) as cluster:
        cluster.recv()
        cluster.pump_until(lambda: all(d.engine.running() for d in cluster.d))
        for p in cluster.p:
            p.engine.cancel(CancelSpec("t1", D_BASE, "prefill ended before its KV was complete"))
        cluster.pump_until(lambda: all(d.recving for d in cluster.d), timeout_s=1.0)
        assert [d.failed_recving for d in cluster.d] == [["req-d"]] * len(cluster.d)


def test_a_release_that_comes_before_the_hold_still_frees_the_replica():
    """READ, H=2 over P TP4 -> D TP1: D's Release for an unread replica (its cover) can reach a P
    rank before that rank's worker added the hold, as D's ReadDone can. Bug: the ReadDone waits
    (records.early, then add_hold splits the hold on it), but the Release is taken for D giving up
    on an unknown transfer: its sub-transfer id is fenced (records.on_message) and add_hold, which
    only looks at early messages (records.early_subs), keeps the whole hold until it expires."""
    with Cluster(READ, 4, 1, 2) as cluster:
        [d] = cluster.d
        cluster.recv()
        cluster.pump_until(lambda: len([s for s in d.notifier.delivered if isinstance(s.message, Release)]) == 2)
        cluster.pump_for(0.05)  # P ranks 1 and 3 took the Releases in, with no hold yet
        cluster.hold(hold_s=30.0)
        cluster.finish()
        cluster.pump_until(lambda: all(p.sending for p in cluster.p) and d.recving, timeout_s=1.0)
        assert (d.recving, d.failed_recving) == (["req-d"], [])
