"""Two TransferEngines (P and D) in one process, moving real bytes through ShmTransport.

No vLLM process, no sockets: a FakeNotifier delivers control messages straight to the engine
of whichever instance listens at the address now (or drops them), only when they are addressed
to that instance's incarnation, and the handshake function answers from that instance's
transport and layout. `Pair.restart` puts a new incarnation at P's or D's address.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from pdserve.config import ConnectorConfig, TransferMode, parse_connector_config
from pdserve.connector.scheduler.prompt_digest import prompt_digest
from pdserve.control.address import PeerAddress
from pdserve.transfer.device_layout import BlockRuns
from pdserve.transfer.engine import Finished, TransferEngine
from pdserve.transfer.incarnation import Incarnation
from pdserve.transfer.layout import KvLayout, LayerPlacement
from pdserve.transfer.peers import HandshakeResult
from pdserve.transport import SharedSegment, ShmTransport, segment_name

NUM_LAYERS = 2
NUM_BLOCKS = 8
BLOCK_BYTES = 64
STATE_BYTES = 40  # a hybrid pair's state per block (`_make_side`)

P_ADDRESS = PeerAddress("127.0.0.1", 6301, 6401)
D_ADDRESS = PeerAddress("127.0.0.1", 6302, 6402)
P_IDENTITY = "127.0.0.1:6301/p"
D_IDENTITY = "127.0.0.1:6302/d"

FAST = {"transfer_timeout": 5.0, "defer_timeout": 5.0, "release_grace": 0.5}
PROMPT_HASH = prompt_digest(range(100))
OTHER_PROMPT_HASH = prompt_digest(range(1, 101))


def secret_file(directory: Path, text: str = "test-secret\n") -> Path:
    """A control-plane secret file only its owner may read, as the codec requires."""
    secret = directory / "secret"
    secret.write_text(text)
    secret.chmod(0o600)
    return secret


def make_config(kv_role: str, mode: TransferMode, **overrides) -> ConnectorConfig:
    # the digest (kv_verify) is off unless a test turns it on: these tests pin the messages exactly
    extra = {**FAST, "kv_verify": "off", **overrides, "read_mode": mode is TransferMode.READ}
    if kv_role == "kv_producer":
        extra.update(handshake_port=P_ADDRESS.handshake_port, notify_port=P_ADDRESS.notify_port)
    else:
        extra.update(handshake_port=D_ADDRESS.handshake_port, notify_port=D_ADDRESS.notify_port)
    return parse_connector_config(kv_role, extra, env={"PDSERVE_SECRET_FILE": "/nonexistent/secret"})


@dataclass
class Sent:
    address: PeerAddress
    message: object
    recipient: str = ""
    at: float = field(default_factory=time.monotonic)


class FakeNotifier:
    """Records every notify; delivers it to the instance registered for the address unless
    `drop`, and only if it is addressed to that instance's incarnation (what the real codec
    enforces). With `refuse`, nothing can be queued: notify answers False (unreachable peer)."""

    def __init__(self, sender_identity: str):
        self.sender_identity = sender_identity
        self.sent: list[Sent] = []
        self.delivered: list[Sent] = []
        self.fenced: list[Sent] = []
        self.targets: dict[tuple[str, int], Instance] = {}
        self.forgotten: list[PeerAddress] = []
        self.drop = False
        self.refuse = False

    def notify(self, address: PeerAddress, message, recipient: str) -> bool:
        sent = Sent(address, message, recipient)
        self.sent.append(sent)
        if self.refuse:
            return False
        target = self.targets.get((address.host, address.notify_port))
        if target is None or self.drop:
            return True
        if recipient != target.identity:
            self.fenced.append(sent)
            return True
        self.delivered.append(sent)
        target.engine.on_message(self.sender_identity, message)
        return True

    def forget(self, address: PeerAddress) -> None:
        self.forgotten.append(address)

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
    refuses: bool = False  # with handshake_error: it answered and refused (an incompatible layout)
    handshake_delay_s: float = 0.0  # a peer that answers slowly
    advertised_layout: KvLayout | None = None  # what the handshake claims, when not `layout`
    handshakes: int = 0
    liveness: tuple = ()  # (pid, start_time, boot_id) a handshake reports; () = unknown (never "gone")
    sending: set[str] = field(default_factory=set)
    recving: set[str] = field(default_factory=set)
    failed_recving: set[str] = field(default_factory=set)
    finished_req_ids: set[str] = field(default_factory=set)
    reported_at: dict[str, float] = field(default_factory=dict)  # request id -> when it was first reported

    # ---- KV bytes --------------------------------------------------------------------------

    def block_range(self, layer: int, block: int) -> tuple[int, int]:
        """A block's bytes; a state layer's: its whole page, padding included."""
        placement = self.layout.layers[layer]
        stride = placement.block_stride if isinstance(placement, BlockRuns) else placement.block_bytes
        start = placement.offset + block * stride
        return start, start + stride

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
        now = time.monotonic()
        for request_id in out.sending | out.recving:
            self.reported_at.setdefault(request_id, now)
        self.sending |= out.sending
        self.recving |= out.recving
        self.failed_recving |= out.failed_recving
        return out

    def handshake(self, address: PeerAddress) -> HandshakeResult:
        """The handshake function the *other* side's engine calls to reach this side."""
        self.handshakes += 1
        time.sleep(self.handshake_delay_s)
        if self.handshake_error:
            return HandshakeResult(address, error=self.handshake_error, refused_by=self.identity if self.refuses else "")
        layout = self.advertised_layout or self.layout
        return HandshakeResult(address, Incarnation(self.identity, *self.liveness),
                               tuple(self.transport.local_descriptors()), layout)

    def close(self) -> None:
        self.engine.close()
        self.transport.close()
        self.segment.close()


def _make_side(name: str, identity: str, layer_offset: int, num_blocks: int = NUM_BLOCKS,
               hybrid: bool = False, transport_factory: Callable[[str], ShmTransport] | None = None) -> Instance:
    """One region holding both layers; `layer_offset` pads before layer 0 so P and D differ.
    `hybrid`: two KV cache groups as vLLM's hybrid KV cache manager keeps a Gated DeltaNet model,
    layer 0 attention (group 0), layer 1 state (group 1, sparse), each of its blocks a state of
    STATE_BYTES at the start of a page padded to BLOCK_BYTES (kv_memory.py `_state_runs`)."""
    size = layer_offset + NUM_LAYERS * num_blocks * BLOCK_BYTES
    segment = SharedSegment.create(segment_name("enginetest", name), size)
    path = segment.unlink_name()
    transport = (transport_factory or ShmTransport)(name)
    transport.register_region(0, segment.address, segment.size, path)
    layers: list = [LayerPlacement(0, layer_offset + i * num_blocks * BLOCK_BYTES, BLOCK_BYTES, num_blocks)
                    for i in range(NUM_LAYERS)]
    if hybrid:
        layers[1] = BlockRuns(0, layers[1].offset, BLOCK_BYTES, STATE_BYTES, (0,), num_blocks)
    layout = KvLayout(tuple(layers), (0, 1), (False, True)) if hybrid else KvLayout(tuple(layers))
    return Instance(name, segment, transport, layout, FakeNotifier(identity), identity)


P_LAYER_OFFSET = 0
D_LAYER_OFFSET = 3 * BLOCK_BYTES


class Pair:
    """P and D wired to each other. Use as a context manager."""

    def __init__(self, mode: TransferMode, p_timeouts: dict | None = None, d_timeouts: dict | None = None,
                 hybrid: bool = False, transport_factory: Callable[[str], ShmTransport] | None = None):
        """`transport_factory(name)`: each side's transport, in place of a ShmTransport."""
        self.mode = mode
        self.p = _make_side("p", P_IDENTITY, layer_offset=P_LAYER_OFFSET, hybrid=hybrid, transport_factory=transport_factory)
        self.d = _make_side("d", D_IDENTITY, layer_offset=D_LAYER_OFFSET, hybrid=hybrid, transport_factory=transport_factory)
        self.retired: list[Instance] = []  # incarnations replaced by `restart`, closed at the end
        self.p_config = make_config("kv_producer", mode, **(p_timeouts or {}))
        self.d_config = make_config("kv_consumer", mode, **(d_timeouts or {}))
        # Each side handshakes whoever listens at the other's address *now* (see `restart`).
        self.p.engine = self._engine(self.p, self.p_config, lambda address: self.d.handshake(address))
        self.d.engine = self._engine(self.d, self.d_config, lambda address: self.p.handshake(address))
        self.p.notifier.targets[(D_ADDRESS.host, D_ADDRESS.notify_port)] = self.d
        self.d.notifier.targets[(P_ADDRESS.host, P_ADDRESS.notify_port)] = self.p
        self.p.fill(seed=11)
        self.d.fill(seed=200)

    @staticmethod
    def _engine(side: Instance, config: ConnectorConfig, handshake) -> TransferEngine:
        return TransferEngine(config, side.layout, side.transport, side.notifier, handshake)

    def restart(self, which: str, identity: str, seed: int) -> Instance:
        """A new incarnation of P ("p") or D ("d") at the same address: its own segment, bytes
        (`seed`), transport and engine. The old one stays alive (its memory still mapped by the
        peer, as a killed process's segment stays while mapped) in `retired` until close."""
        old = self.p if which == "p" else self.d
        config = self.p_config if which == "p" else self.d_config
        offset = P_LAYER_OFFSET if which == "p" else D_LAYER_OFFSET
        new = _make_side(f"{which}{len(self.retired) + 2}", identity, layer_offset=offset)
        other = self.d if which == "p" else self.p
        new.engine = self._engine(new, config, lambda address: (self.d if which == "p" else self.p).handshake(address))
        new.notifier.targets = dict(old.notifier.targets)
        address = P_ADDRESS if which == "p" else D_ADDRESS
        other.notifier.targets[(address.host, address.notify_port)] = new
        new.fill(seed)
        self.retired.append(old)
        if which == "p":
            self.p = new
        else:
            self.d = new
        return new

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
        for side in (self.p, self.d, *self.retired):
            side.close()

    def __enter__(self) -> Pair:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
