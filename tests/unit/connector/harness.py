"""Two TransferEngines (P and D) in one process, moving real bytes through ShmTransport.

No vLLM process, no sockets: a FakeNotifier delivers control messages straight to the other
engine's `on_message` (or drops them), and the handshake function answers from the other side's
transport and layout.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from pdserve.config import ConnectorConfig, TransferMode, parse_connector_config
from pdserve.connector.engine import Finished, TransferEngine
from pdserve.connector.layout import KvLayout, LayerPlacement
from pdserve.connector.peers import HandshakeResult
from pdserve.control.address import PeerAddress
from pdserve.control.messages import ReadDone
from pdserve.errors import PDServeError
from pdserve.transport import SharedSegment, ShmTransport, segment_name

NUM_LAYERS = 2
NUM_BLOCKS = 8
BLOCK_BYTES = 64

P_ADDRESS = PeerAddress("127.0.0.1", 6301, 6401)
D_ADDRESS = PeerAddress("127.0.0.1", 6302, 6402)
P_IDENTITY = "127.0.0.1:6301/p"
D_IDENTITY = "127.0.0.1:6302/d"

FAST = {"transfer_timeout": 5.0, "defer_timeout": 5.0, "release_grace": 5.0}


def make_config(kv_role: str, mode: TransferMode, **timeouts) -> ConnectorConfig:
    extra = {**FAST, **timeouts, "read_mode": mode is TransferMode.READ}
    if kv_role == "kv_producer":
        extra.update(handshake_port=P_ADDRESS.handshake_port, notify_port=P_ADDRESS.notify_port)
    else:
        extra.update(handshake_port=D_ADDRESS.handshake_port, notify_port=D_ADDRESS.notify_port)
    return parse_connector_config(kv_role, extra, env={"PDSERVE_SECRET_FILE": "/nonexistent/secret"})


@dataclass
class Sent:
    address: PeerAddress
    message: object


class FakeNotifier:
    """Records every notify; delivers it to the engine registered for the address unless `drop`."""

    def __init__(self, sender_identity: str):
        self.sender_identity = sender_identity
        self.sent: list[Sent] = []
        self.asked: list[Sent] = []
        self.targets: dict[PeerAddress, TransferEngine] = {}
        self.drop = False

    def notify(self, address: PeerAddress, message) -> None:
        self.sent.append(Sent(address, message))
        target = self.targets.get(address)
        if target is not None and not self.drop:
            target.on_message(self.sender_identity, message)

    def ask(self, address: PeerAddress, message):
        """A request to the peer's handshake port (READ: ReadDone -> ReadAck); runs on a pool thread."""
        self.asked.append(Sent(address, message))
        target = self.targets.get(address)
        if target is None or self.drop:
            raise PDServeError(f"no answer from {address.host}:{address.handshake_port}")
        if isinstance(message, ReadDone):
            return target.answer_read_done(message)
        raise PDServeError(f"the fake peer does not answer {type(message).__name__}")

    def messages(self, kind: type) -> list:
        return [s.message for s in self.sent if isinstance(s.message, kind)]


@dataclass
class Instance:
    """One instance: its KV segment, transport, layout, engine, and what it reported so far."""

    name: str
    segment: SharedSegment
    transport: ShmTransport
    layout: KvLayout
    notifier: FakeNotifier
    identity: str
    engine: TransferEngine | None = None
    handshake_error: str = ""
    handshake_delay_s: float = 0.0  # a peer that answers slowly
    advertised_layout: KvLayout | None = None  # what the handshake claims, when not `layout`
    handshakes: int = 0
    sending: set[str] = field(default_factory=set)
    recving: set[str] = field(default_factory=set)
    failed_recving: set[str] = field(default_factory=set)
    finished_req_ids: set[str] = field(default_factory=set)

    # ---- KV bytes --------------------------------------------------------------------------

    def block_range(self, layer: int, block: int) -> tuple[int, int]:
        placement = self.layout.layers[layer]
        start = placement.offset + block * placement.block_bytes
        return start, start + placement.block_bytes

    def read_block(self, layer: int, block: int) -> bytes:
        start, end = self.block_range(layer, block)
        return self.segment.mmap[start:end]

    def fill(self, seed: int) -> None:
        """Give every (layer, block) distinct bytes."""
        for layer in range(NUM_LAYERS):
            for block in range(NUM_BLOCKS):
                start, end = self.block_range(layer, block)
                self.segment.mmap[start:end] = bytes([(seed + layer * 31 + block * 7 + i) % 256 for i in range(end - start)])

    def snapshot(self) -> dict[tuple[int, int], bytes]:
        return {(l, b): self.read_block(l, b) for l in range(NUM_LAYERS) for b in range(NUM_BLOCKS)}

    # ---- progress --------------------------------------------------------------------------

    def pump(self) -> Finished:
        self.engine.pump()
        out = self.engine.take_finished(set(self.finished_req_ids))
        self.finished_req_ids.clear()
        self.sending |= out.sending
        self.recving |= out.recving
        self.failed_recving |= out.failed_recving
        return out

    def handshake(self, address: PeerAddress) -> HandshakeResult:
        """The handshake function the *other* side's engine calls to reach this side."""
        self.handshakes += 1
        time.sleep(self.handshake_delay_s)
        if self.handshake_error:
            return HandshakeResult(address, error=self.handshake_error)
        layout = self.advertised_layout or self.layout
        return HandshakeResult(address, self.identity, tuple(self.transport.local_descriptors()), layout)


def _make_side(name: str, identity: str, layer_offset: int, num_blocks: int = NUM_BLOCKS) -> Instance:
    """One region holding both layers; `layer_offset` pads before layer 0 so P and D differ."""
    size = layer_offset + NUM_LAYERS * num_blocks * BLOCK_BYTES
    segment = SharedSegment.create(segment_name("enginetest", name), size)
    path = segment.unlink_name()
    transport = ShmTransport(name)
    transport.register_region(0, segment.address, segment.size, path)
    layout = KvLayout(tuple(
        LayerPlacement(0, layer_offset + i * num_blocks * BLOCK_BYTES, BLOCK_BYTES, num_blocks)
        for i in range(NUM_LAYERS)
    ))
    return Instance(name, segment, transport, layout, FakeNotifier(identity), identity)


class Pair:
    """P and D wired to each other. Use as a context manager."""

    def __init__(self, mode: TransferMode, p_timeouts: dict | None = None, d_timeouts: dict | None = None):
        self.mode = mode
        self.p = _make_side("p", P_IDENTITY, layer_offset=0)
        self.d = _make_side("d", D_IDENTITY, layer_offset=3 * BLOCK_BYTES)
        self.p_config = make_config("kv_producer", mode, **(p_timeouts or {}))
        self.d_config = make_config("kv_consumer", mode, **(d_timeouts or {}))
        self.p.engine = TransferEngine(self.p_config, self.p.layout, self.p.transport, self.p.notifier, self.d.handshake)
        self.d.engine = TransferEngine(self.d_config, self.d.layout, self.d.transport, self.d.notifier, self.p.handshake)
        self.p.notifier.targets[D_ADDRESS] = self.d.engine
        self.d.notifier.targets[P_ADDRESS] = self.p.engine
        self.p.fill(seed=11)
        self.d.fill(seed=200)

    def pump(self, sides: tuple[Instance, ...] | None = None) -> None:
        for side in sides or (self.p, self.d):
            side.pump()

    def pump_until(self, condition, timeout_s: float = 5.0, sides: tuple[Instance, ...] | None = None) -> float:
        """Pump (both sides, or `sides`) until `condition()`; returns the seconds it took; fails at
        the deadline."""
        start = time.monotonic()
        while True:
            self.pump(sides)
            if condition():
                return time.monotonic() - start
            if time.monotonic() - start > timeout_s:
                raise AssertionError(f"condition not met within {timeout_s} s: {self.summary()}")
            time.sleep(0.002)

    def pump_for(self, seconds: float, sides: tuple[Instance, ...] | None = None) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            self.pump(sides)
            time.sleep(0.002)

    def summary(self) -> str:
        return (f"P sending={self.p.sending} | D recving={self.d.recving} failed={self.d.failed_recving} | "
                f"P sent {[s.message for s in self.p.notifier.sent]} | D sent {[s.message for s in self.d.notifier.sent]}")

    def close(self) -> None:
        for side in (self.p, self.d):
            side.engine.close()
            side.transport.close()
            side.segment.close()

    def __enter__(self) -> Pair:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
