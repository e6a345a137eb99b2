"""Which P rank moves which KV heads to which D rank (transfer/ranks.py)."""

from __future__ import annotations

import pytest

from pdserve.errors import IncompatiblePeerError, ProtocolError
from pdserve.transfer.ranks import (
    HeadSlice,
    RankPair,
    Ranks,
    SubName,
    coverer,
    pairs_for,
    parse_sub_id,
    sub_id,
)

# (P TP size, D TP size, model KV heads)
LAYOUTS = [(2, 1, 2), (1, 2, 2), (2, 2, 2), (4, 2, 4), (2, 4, 4), (4, 1, 2), (1, 4, 2), (4, 4, 2), (2, 1, 1)]


def heads_moved(pair: RankPair, prefill: Ranks, decode: Ranks) -> list[int]:
    """The model heads a pair moves, as D's view of it says."""
    wanted = decode.heads_of(pair.decode)
    if pair.heads is None:
        assert prefill.heads_of(pair.prefill) == wanted, "whole blocks move only between ranks of the same heads"
        return list(wanted)
    first = wanted.start + pair.heads.first_local
    return list(range(first, first + pair.heads.count))


def views(p_size: int, d_size: int, heads: int) -> tuple[dict, dict]:
    """Every pair as P's ranks see it and as D's ranks see it, keyed by (P rank, D rank)."""
    p_view = {(pair.prefill, pair.decode): pair for p in range(p_size)
              for pair in pairs_for(Ranks(p, p_size, heads), d_size, local_is_prefill=True)}
    d_view = {(pair.prefill, pair.decode): pair for d in range(d_size)
              for pair in pairs_for(Ranks(d, d_size, heads), p_size, local_is_prefill=False)}
    return p_view, d_view


def test_heads_of_splits_heads_evenly_when_there_are_enough():
    ranks = Ranks(0, 2, 8)
    assert [ranks.heads_of(r) for r in range(2)] == [range(0, 4), range(4, 8)]
    assert ranks.local_heads == 4
    assert [Ranks(0, 4, 4).heads_of(r) for r in range(4)] == [range(r, r + 1) for r in range(4)]


def test_heads_of_replicates_when_ranks_outnumber_heads():
    """vLLM's rule: rank r of T ranks holds head r*H//T."""
    ranks = Ranks(0, 4, 2)
    assert [ranks.heads_of(r) for r in range(4)] == [range(0, 1), range(0, 1), range(1, 2), range(1, 2)]
    assert ranks.local_heads == 1
    assert [Ranks(0, 8, 2).heads_of(r).start for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]


@pytest.mark.parametrize("p_size,d_size,heads", LAYOUTS)
def test_each_d_rank_gets_each_of_its_heads_from_exactly_one_p_rank_holding_it(p_size, d_size, heads):
    prefill, decode = Ranks(0, p_size, heads), Ranks(0, d_size, heads)
    _, d_view = views(p_size, d_size, heads)
    for d in range(d_size):
        moved = []
        for (p, _), pair in sorted((k, v) for k, v in d_view.items() if k[1] == d):
            got = heads_moved(pair, prefill, decode)
            assert set(got) <= set(prefill.heads_of(p)), f"D rank {d} takes heads {got} P rank {p} lacks"
            moved += got
        assert sorted(moved) == list(decode.heads_of(d)), f"D rank {d} gets heads {moved}"


@pytest.mark.parametrize("p_size,d_size,heads", LAYOUTS)
def test_p_and_d_see_the_same_pairs_with_mirrored_slices(p_size, d_size, heads):
    p_view, d_view = views(p_size, d_size, heads)
    assert p_view.keys() == d_view.keys()
    for key, on_p in p_view.items():
        on_d = d_view[key]
        assert (on_p.prefill, on_p.decode) == (on_d.prefill, on_d.decode) == key
        if on_p.heads is None:
            assert on_d.heads is None
        else:
            assert on_d.heads == HeadSlice(on_p.heads.first_peer, on_p.heads.first_local, on_p.heads.count)
        p, d = key
        assert sub_id("t1", p, p_size, d, d_size) == sub_id("t1", on_d.prefill, p_size, on_d.decode, d_size)


@pytest.mark.parametrize("p_size,d_size,heads", LAYOUTS)
def test_each_p_rank_nobody_reads_from_is_covered_by_exactly_one_d_rank(p_size, d_size, heads):
    prefill = Ranks(0, p_size, heads)
    p_view, _ = views(p_size, d_size, heads)
    read = {p for p, _ in p_view}
    for p in range(p_size):
        # what each D rank's Fanout._cover decides for P rank p
        covering = [d for d in range(d_size) if coverer(prefill, d_size, p) == d]
        assert len(covering) == (0 if p in read else 1), f"P rank {p} is covered by D ranks {covering}"


def test_replicated_p_leaves_ranks_unread_and_names_their_coverer():
    prefill = Ranks(0, 4, 2)  # ranks 0, 1 hold head 0; ranks 2, 3 head 1
    p_view, _ = views(4, 1, 2)
    assert sorted(p_view) == [(0, 0), (2, 0)]
    assert [coverer(prefill, 1, p) for p in range(4)] == [None, 0, None, 0]
    # D rank 0 reads head 0 from P rank 0, D rank 1 head 1 from P rank 3 (replica d % 2)
    assert sorted(views(4, 2, 2)[0]) == [(0, 0), (3, 1)]
    assert [coverer(prefill, 2, p) for p in range(4)] == [None, 1, 0, None]


def test_p_tp2_to_d_tp1_pair_with_rank_1_copies_p_head_0_into_d_head_1():
    on_d = pairs_for(Ranks(0, 1, 2), 2, local_is_prefill=False)
    assert on_d == [RankPair(0, 0, HeadSlice(0, 0, 1)), RankPair(1, 0, HeadSlice(first_local=1, first_peer=0, count=1))]
    assert pairs_for(Ranks(1, 2, 2), 1, local_is_prefill=True) == [RankPair(1, 0, HeadSlice(0, 1, 1))]


def test_ranks_of_the_same_heads_move_whole_blocks():
    assert pairs_for(Ranks(1, 2, 4), 2, local_is_prefill=True) == [RankPair(1, 1, None)]
    assert pairs_for(Ranks(0, 1, 1), 1, local_is_prefill=False) == [RankPair(0, 0, None)]


@pytest.mark.parametrize("transfer_id", ["t1", "3f2a-9c", "odd#id", "x#1/2>0/1"])
def test_sub_id_round_trips(transfer_id):
    name = sub_id(transfer_id, 3, 4, 1, 2)
    assert name != transfer_id
    assert parse_sub_id(name) == SubName(transfer_id, 3, 4, 1, 2)


@pytest.mark.parametrize("name", ["t1", "req-123", "t1#x", "t1#1/2", "t1#1/2>0", "#1/2>0/1", "t1#1/2>0/1 "])
def test_plain_ids_parse_to_none(name):
    assert parse_sub_id(name) is None


def test_sub_id_is_the_transfer_id_between_tp1_instances():
    assert sub_id("t1", 0, 1, 0, 1) == "t1"
    assert sub_id("t1", 0, 2, 0, 1) == "t1#0/2>0/1"
    assert sub_id("t1", 0, 1, 0, 2) == "t1#0/1>0/2"


@pytest.mark.parametrize("args,error,field", [
    ((2, 2, 4), ProtocolError, "rank 2 is not below size 2"),
    ((-1, 2, 4), ProtocolError, "rank must be"),
    ((0, 0, 4), ProtocolError, "size must be"),
    ((0, 2, 0), ProtocolError, "total_heads must be"),
    ((True, 2, 4), ProtocolError, "rank must be"),
    ((0, 2, 3), IncompatiblePeerError, "3 KV heads do not divide over 2 ranks"),
    ((0, 3, 2), IncompatiblePeerError, "2 KV heads do not divide over 3 ranks"),
])
def test_ranks_refuses_bad_values_naming_the_field(args, error, field):
    with pytest.raises(error, match=field):
        Ranks(*args)


def test_ranks_wire_round_trip_and_malformed():
    assert Ranks.from_wire(Ranks(1, 4, 8).to_wire()) == Ranks(1, 4, 8)
    with pytest.raises(ProtocolError, match="rank, size, total_heads"):
        Ranks.from_wire([1, 4])
