"""Which tensor-parallel rank of P moves which KV heads to which rank of D.

Each rank of an instance with TP size T holds a slice of the model's H KV heads: H / T
consecutive heads when T <= H, else one head replicated on T / H ranks (vLLM's rule). vLLM's CPU
KV layout puts heads outermost inside a block, so the heads a rank pair shares are one contiguous
byte range of each side's block: a transfer between instances of different TP sizes splits into
one *sub-transfer* per (P rank, D rank) pair, each copying that range of every block.

Both sides derive the same pairs from the same three numbers (H and the two TP sizes) and name
each sub-transfer alike (`sub_id`), so no message says who pairs with whom. Where a head is held
by several P ranks (replicated), D rank d reads the replica d picks (spreading D's ranks over P's),
and a P rank no D rank needs is told so by one D rank (`coverer`), so it frees its blocks at once.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from pdserve.control.address import PeerAddress
from pdserve.errors import IncompatiblePeerError, ProtocolError

MAX_TP = 1024
_SUB = re.compile(r"(.+)#(\d{1,4})/(\d{1,4})>(\d{1,4})/(\d{1,4})")


@dataclass(frozen=True)
class Ranks:
    """One instance's tensor-parallel layout as one of its ranks sees it."""

    rank: int
    size: int
    total_heads: int  # KV heads of the whole model (1 for MLA: one latent per token)

    def __post_init__(self) -> None:
        for name, value, low in (("rank", self.rank, 0), ("size", self.size, 1), ("total_heads", self.total_heads, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= MAX_TP * 64:
                raise ProtocolError(f"tensor-parallel layout: {name} must be an integer >= {low}, got {value!r:.40}")
        if self.rank >= self.size:
            raise ProtocolError(f"tensor-parallel layout: rank {self.rank} is not below size {self.size}")
        if self.size > MAX_TP:
            raise ProtocolError(f"tensor-parallel layout: size {self.size} is above {MAX_TP}")
        if self.total_heads % min(self.size, self.total_heads) or (self.size > self.total_heads and
                                                                     self.size % self.total_heads):
            raise IncompatiblePeerError(f"{self.total_heads} KV heads do not divide over {self.size} ranks")

    @property
    def local_heads(self) -> int:
        return max(1, self.total_heads // self.size)

    def heads_of(self, rank: int) -> range:
        """The model's KV heads rank `rank` of this instance holds."""
        if self.size <= self.total_heads:
            per = self.total_heads // self.size
            return range(rank * per, (rank + 1) * per)
        head = rank * self.total_heads // self.size
        return range(head, head + 1)

    def to_wire(self) -> list[int]:
        return [self.rank, self.size, self.total_heads]

    @classmethod
    def from_wire(cls, data) -> Ranks:
        if not (isinstance(data, list) and len(data) == 3):
            raise ProtocolError(f"tensor-parallel layout must be [rank, size, total_heads], got {data!r:.80}")
        return cls(*data)


SINGLE = Ranks(0, 1, 1)  # an instance without tensor parallelism (head counts then play no part)


@dataclass(frozen=True)
class HeadSlice:
    """The heads one rank pair shares, as head offsets into each side's block."""

    first_local: int  # index, among this rank's heads, of the first shared one
    first_peer: int  # likewise on the peer rank
    count: int


@dataclass(frozen=True)
class Slicing:
    """What a sub-transfer between ranks holding different heads copies of each block."""

    heads: HeadSlice
    local_heads: int  # heads in one of this rank's blocks
    peer_heads: int  # heads in one of the peer rank's blocks


@dataclass(frozen=True)
class RankPair:
    prefill: int  # P's rank
    decode: int  # D's rank
    heads: HeadSlice | None  # None: both ranks hold exactly the same heads (whole blocks move)


def pairs_for(local: Ranks, peer_size: int, local_is_prefill: bool) -> list[RankPair]:
    """The sub-transfers this rank takes part in with an instance of TP size `peer_size` of the same
    model: those whose pairs name this rank (a rank may have none: a replica nobody needs)."""
    peer = Ranks(0, peer_size, local.total_heads)
    prefill, decode = (local, peer) if local_is_prefill else (peer, local)
    pairs = []
    for d in range(decode.size):
        for p, shared in _sources(prefill, decode, d):
            if (p if local_is_prefill else d) == local.rank:
                pairs.append(RankPair(p, d, _slice(prefill, p, decode, d, shared, local_is_prefill)))
    return pairs


def coverer(prefill: Ranks, decode_size: int, p: int) -> int | None:
    """The D rank that tells P rank `p` to let go of a prompt no D rank reads from it, or None when
    some D rank pairs with `p`."""
    decode = Ranks(0, decode_size, prefill.total_heads)
    if any(src == p for d in range(decode_size) for src, _ in _sources(prefill, decode, d)):
        return None
    return p % decode_size


def _sources(prefill: Ranks, decode: Ranks, d: int) -> list[tuple[int, range]]:
    """P ranks D rank `d` takes its heads from, each with the model heads it takes."""
    wanted = decode.heads_of(d)
    out = []
    for head in wanted:
        holders = [p for p in range(prefill.size) if head in prefill.heads_of(p)]
        p = holders[d % len(holders)]
        if out and out[-1][0] == p:
            out[-1] = (p, range(out[-1][1].start, head + 1))
        else:
            out.append((p, range(head, head + 1)))
    return out


def _slice(prefill: Ranks, p: int, decode: Ranks, d: int, shared: range, local_is_prefill: bool) -> HeadSlice | None:
    p_heads, d_heads = prefill.heads_of(p), decode.heads_of(d)
    if p_heads == d_heads:
        return None
    on_p, on_d = shared.start - p_heads.start, shared.start - d_heads.start
    first_local, first_peer = (on_p, on_d) if local_is_prefill else (on_d, on_p)
    return HeadSlice(first_local, first_peer, len(shared))


def sub_id(transfer_id: str, prefill: int, prefill_size: int, decode: int, decode_size: int) -> str:
    """The id both ranks of a pair give their sub-transfer; the transfer's own id between TP 1 instances."""
    if prefill_size == 1 and decode_size == 1:
        return transfer_id
    return f"{transfer_id}#{prefill}/{prefill_size}>{decode}/{decode_size}"


@dataclass(frozen=True)
class SubName:
    transfer_id: str
    prefill: int
    prefill_size: int
    decode: int
    decode_size: int


def parse_sub_id(name: str) -> SubName | None:
    """The parts of a sub-transfer id, or None for a plain transfer id."""
    match = _SUB.fullmatch(name)
    if match is None:
        return None
    tid, p, ps, d, ds = match.groups()
    return SubName(tid, int(p), int(ps), int(d), int(ds))


def rank_address(base: PeerAddress, rank: int) -> PeerAddress:
    """Where rank `rank` of the instance whose rank 0 listens at `base` listens."""
    return PeerAddress(base.host, base.handshake_port + rank, base.notify_port + rank)
