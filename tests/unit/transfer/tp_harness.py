"""P and D instances of any tensor-parallel sizes in one process: one TransferEngine per rank,
each moving real bytes through its own ShmTransport.

Rank r of an instance listens at its base address + r (ranks.rank_address). A handshake is
answered by whichever rank listens at the address asked (its incarnation, regions, layout and
`Ranks`); a FakeNotifier delivers each control message to the rank listening at the notify port it
is addressed to. Each rank's blocks hold only its own heads (`local_heads * HEAD_BYTES` bytes),
head after head; P's bytes name (layer, block, model head), so what D must hold after a
transfer can be computed (`Cluster.expected`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from pdserve.config import ConnectorConfig, TransferMode, parse_connector_config
from pdserve.control.address import PeerAddress
from pdserve.transfer.engine import TransferEngine
from pdserve.transfer.incarnation import Incarnation
from pdserve.transfer.layout import KvLayout, LayerPlacement
from pdserve.transfer.peers import HandshakeResult
from pdserve.transfer.ranks import Ranks, rank_address
from pdserve.transfer.specs import HoldSpec, RecvSpec, SendSpec
from pdserve.transport import SharedSegment, ShmTransport, segment_name
from tests.unit.connector.harness import FAST, PROMPT_HASH, FakeNotifier

NUM_LAYERS = 2
NUM_BLOCKS = 8
HEAD_BYTES = 16

P_BASE = PeerAddress("127.0.0.1", 6501, 6601)  # P's rank 0; rank r at ports + r
D_BASE = PeerAddress("127.0.0.1", 6521, 6621)
P_BLOCKS = (5, 6, 7, 0)
D_BLOCKS = (1, 2, 3, 4)

WRITE, READ = TransferMode.WRITE, TransferMode.READ


def head_bytes(side: str, layer: int, block: int, head: int) -> bytes:
    """What model head `head` of `block` in `layer` holds on `side` ("p" or "d") before any transfer."""
    tag = 0xA0 if side == "p" else 0xD0
    return bytes([tag | layer, block, head]) + bytes((head * 16 + i) % 256 for i in range(3, HEAD_BYTES))


@dataclass
class Rank:
    """One rank of an instance: its KV segment, transport, layout, engine, and every report it made
    (lists, so a request reported twice shows twice)."""

    side: str  # "p" or "d"
    ranks: Ranks
    address: PeerAddress
    identity: str
    segment: SharedSegment
    transport: ShmTransport
    layout: KvLayout
    notifier: FakeNotifier
    engine: TransferEngine | None = None
    handshake_error: str = ""  # answer every handshake with this error
    refuses: bool = False  # with handshake_error: it answered and refused (an incompatible layout)
    sending: list[str] = field(default_factory=list)
    recving: list[str] = field(default_factory=list)
    failed_recving: list[str] = field(default_factory=list)
    finished_req_ids: set[str] = field(default_factory=set)  # vLLM finished these: passed on the next pump

    @property
    def name(self) -> str:
        return f"{self.side.upper()}{self.ranks.rank}"

    def read_block(self, layer: int, block: int) -> bytes:
        placement = self.layout.layers[layer]
        start = placement.offset + block * placement.block_bytes
        return bytes(self.segment.mmap[start:start + placement.block_bytes])

    def fill(self) -> None:
        """Every block holds this rank's heads, each `head_bytes` of its model head index."""
        for layer, placement in enumerate(self.layout.layers):
            for block in range(NUM_BLOCKS):
                start = placement.offset + block * placement.block_bytes
                data = b"".join(head_bytes(self.side, layer, block, head) for head in self.ranks.heads_of(self.ranks.rank))
                self.segment.mmap[start:start + len(data)] = data

    def snapshot(self) -> dict[tuple[int, int], bytes]:
        return {(layer, block): self.read_block(layer, block) for layer in range(NUM_LAYERS) for block in range(NUM_BLOCKS)}

    def pump(self) -> None:
        self.engine.pump()
        out = self.engine.take_finished(set(self.finished_req_ids))
        self.finished_req_ids.clear()
        self.sending += sorted(out.sending)
        self.recving += sorted(out.recving)
        self.failed_recving += sorted(out.failed_recving)

    def handshake(self, address: PeerAddress) -> HandshakeResult:
        """What this rank answers a peer's handshake with."""
        if self.handshake_error:
            return HandshakeResult(address, error=self.handshake_error, refused_by=self.identity if self.refuses else "")
        return HandshakeResult(address, Incarnation(self.identity), tuple(self.transport.local_descriptors()),
                               self.layout, ranks=self.ranks)

    def close(self) -> None:
        self.engine.close()
        self.transport.close()
        self.segment.close()


class Cluster:
    """A P instance of TP size `p_size` and a D instance of TP size `d_size` of a model with `heads`
    KV heads, every rank wired to every other. Use as a context manager."""

    def __init__(self, mode: TransferMode, p_size: int, d_size: int, heads: int,
                 p_timeouts: dict | None = None, d_timeouts: dict | None = None):
        self.mode = mode
        self._targets: dict[tuple[str, int], Rank] = {}  # (host, notify port) -> the rank listening there
        self._listeners: dict[tuple[str, int], Rank] = {}  # (host, handshake port) -> the rank listening there
        self.p = [self._rank("p", Ranks(r, p_size, heads), P_BASE, p_timeouts) for r in range(p_size)]
        self.d = [self._rank("d", Ranks(r, d_size, heads), D_BASE, d_timeouts) for r in range(d_size)]

    def _rank(self, side: str, ranks: Ranks, base: PeerAddress, timeouts: dict | None) -> Rank:
        address = rank_address(base, ranks.rank)
        block_bytes = ranks.local_heads * HEAD_BYTES
        pad = 0 if side == "p" else 3 * block_bytes  # P's and D's layers lie at different offsets
        segment = SharedSegment.create(segment_name("tptest", f"{side}{ranks.rank}"), pad + NUM_LAYERS * NUM_BLOCKS * block_bytes)
        transport = ShmTransport(f"{side}{ranks.rank}")
        transport.register_region(0, segment.address, segment.size, segment.unlink_name())
        layout = KvLayout(tuple(LayerPlacement(0, pad + i * NUM_BLOCKS * block_bytes, block_bytes, NUM_BLOCKS)
                                for i in range(NUM_LAYERS)))
        identity = f"{address.host}:{address.handshake_port}/{side}{ranks.rank}"
        notifier = FakeNotifier(identity)
        notifier.targets = self._targets  # shared: every rank reaches every listening rank
        rank = Rank(side, ranks, address, identity, segment, transport, layout, notifier)
        rank.engine = TransferEngine(self._config(side, address, timeouts), layout, transport, notifier, self._answer,
                                     ranks=ranks)
        rank.fill()
        self._targets[(address.host, address.notify_port)] = rank
        self._listeners[(address.host, address.handshake_port)] = rank
        return rank

    def _config(self, side: str, address: PeerAddress, timeouts: dict | None) -> ConnectorConfig:
        extra = {**FAST, **(timeouts or {}), "read_mode": self.mode is READ,
                 "handshake_port": address.handshake_port, "notify_port": address.notify_port}
        role = "kv_producer" if side == "p" else "kv_consumer"
        return parse_connector_config(role, extra, env={"PDSERVE_SECRET_FILE": "/nonexistent/secret"})

    def _answer(self, address: PeerAddress) -> HandshakeResult:
        rank = self._listeners.get((address.host, address.handshake_port))
        if rank is None:
            return HandshakeResult(address, error=f"nobody listens at {address.host}:{address.handshake_port}")
        return rank.handshake(address)

    @property
    def ranks(self) -> list[Rank]:
        return [*self.p, *self.d]

    # ---- what vLLM hands each rank (the same spec to every rank of an instance) -------------

    def send(self, request_id="req-p", transfer_id="t1", blocks=P_BLOCKS, ranks=None) -> None:
        """P, WRITE: the step computes the prompt's last chunk, every layer."""
        for rank in self.p if ranks is None else ranks:
            rank.engine.begin_step()
            rank.engine.add_send(SendSpec(request_id, transfer_id, D_BASE, tuple(blocks), PROMPT_HASH))
            rank.engine.all_layers_ready()

    def hold(self, request_id="req-p", transfer_id="t1", blocks=P_BLOCKS, hold_s=30.0, ranks=None) -> None:
        """P, READ: the request finished; hold its blocks for D."""
        for rank in self.p if ranks is None else ranks:
            rank.engine.begin_step()
            rank.engine.add_hold(HoldSpec(request_id, transfer_id, tuple(blocks), time.time() + hold_s, PROMPT_HASH))

    def recv(self, request_id="req-d", transfer_id="t1", blocks=D_BLOCKS, remote=P_BLOCKS, first_block=0,
             ranks=None) -> None:
        """D: blocks allocated for a remote prefill at P's rank-0 address."""
        read = self.mode is READ
        spec = RecvSpec(request_id, transfer_id, self.mode, P_BASE, tuple(blocks), first_block,
                        tuple(remote) if read else None, time.time() + 30 if read else None, PROMPT_HASH)
        for rank in self.d if ranks is None else ranks:
            rank.engine.add_recv(spec)

    def finish(self, request_id="req-p") -> None:
        """vLLM finished the request on every P rank (its blocks may be freed once sent)."""
        for rank in self.p:
            rank.finished_req_ids.add(request_id)

    # ---- progress --------------------------------------------------------------------------

    def pump(self, ranks=None) -> None:
        for rank in self.ranks if ranks is None else ranks:
            rank.pump()

    def pump_until(self, condition, timeout_s: float = 3.0, ranks=None) -> float:
        """Pump (every rank, or `ranks`) until `condition()`; returns the seconds it took; fails at
        the deadline."""
        start = time.monotonic()
        while True:
            self.pump(ranks)
            if condition():
                return time.monotonic() - start
            if time.monotonic() - start > timeout_s:
                raise AssertionError(f"condition not met within {timeout_s} s: {self.summary()}")
            time.sleep(0.002)

    def pump_for(self, seconds: float, ranks=None) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            self.pump(ranks)
            time.sleep(0.002)

    def summary(self) -> str:
        return " | ".join(f"{r.name} sending={r.sending} recving={r.recving} failed={r.failed_recving} "
                          f"active={[t.transfer_id for t in r.engine.running()]}" for r in self.ranks)

    # ---- expectations ----------------------------------------------------------------------

    def expected(self, d: Rank, d_before: dict, blocks=D_BLOCKS, remote=P_BLOCKS, first_block=0) -> dict:
        """D rank `d`'s blocks once P's `remote[first_block:]` landed in `blocks[first_block:]`:
        those hold P's bytes of exactly the heads `d` owns, every other block is as before."""
        expected = dict(d_before)
        for p_block, d_block in list(zip(remote, blocks))[first_block:]:
            for layer in range(NUM_LAYERS):
                expected[(layer, d_block)] = b"".join(head_bytes("p", layer, p_block, head)
                                                      for head in d.ranks.heads_of(d.ranks.rank))
        return expected

    def close(self) -> None:
        for rank in self.ranks:
            rank.close()

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
