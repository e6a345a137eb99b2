"""The worker half of PDConnector: owns the KV memory, the control-plane servers and the transport.

It runs in vLLM's worker process. At `register_kv_caches` it builds the transport for where the
KV cache is (host memory: moved into shared memory in place; a GPU: device_transport.py, the
device known only then) and starts two control-plane servers (handshake, notify) bound to the
configured host. Each step it hands the scheduler's decisions and the forward pass's progress to
the `TransferEngine`, and reports finished transfers back.
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from pdserve.config import ConnectorConfig
from pdserve.connector.guard import guarded
from pdserve.connector.kv_groups import ONE_GROUP, KvGroups
from pdserve.connector.metadata import StageSpec, StepPlan
from pdserve.connector.worker.decode_serving import DecodeServing
from pdserve.connector.worker.idle_pump import IdlePump
from pdserve.connector.worker.kv_memory import KvMemory
from pdserve.connector.worker.worker_stats import WorkerStats
from pdserve.control.address import PeerAddress
from pdserve.control.codec import Codec, Envelope
from pdserve.control.endpoint import Client, Server
from pdserve.control.messages import (
    HandshakeRefused,
    HandshakeReply,
    HandshakeRequest,
    Ping,
    Pong,
    ReadAck,
    ReadDone,
    Release,
    RemoteBlocks,
    WriteDone,
)
from pdserve.control.secret import load_secret
from pdserve.errors import IncompatiblePeerError, PDServeError, ProtocolError
from pdserve.placement.messages import DecodeStatus, PrefillLoad
from pdserve.rigs import attach_rig
from pdserve.transfer.engine import Finished, TransferEngine
from pdserve.transfer.incarnation import Incarnation
from pdserve.transfer.layout import KvLayout, check_compatible
from pdserve.transfer.peers import HandshakeResult
from pdserve.transfer.ranks import SINGLE, Ranks
from pdserve.transport.base import RegionDescriptor, TransferStatus, Transport
from pdserve.transport.device import MemoryDevice
from pdserve.transport.device_backend import DeviceBackend
from pdserve.transport.device_transport import backend_for, build_device_transport
from pdserve.transport.nixl_auto import PeerRoute, build_transport
from pdserve.transport.nixl_host import HostClaim, HostProof, verify
from pdserve.transport.shared_segment import sweep_stale_segments
from pdserve.transport.shm import ShmTransport

logger = logging.getLogger("pdserve.connector")

IDLE_WAIT_S = 0.002  # an empty engine step waits this long for transfer progress
STAGE_SETTLE_S = 1.0  # past its deadline a staging copy settles within this (its windows in flight complete)
# what the engine handles (every message but the handshake's and the liveness ping's)
TRANSFER_MESSAGES = (RemoteBlocks, WriteDone, Release, ReadDone, ReadAck, PrefillLoad, DecodeStatus)


@dataclass
class StepFlags:
    """What the current engine step's hooks need to know of its plan."""

    sends: bool = False  # the step has sends: its layers are handed to the engine as computed
    idle: bool = False  # the step schedules no tokens: `take_finished` may wait briefly for progress
    stages: list[StageSpec] = field(default_factory=list)  # host staging: blocks to stage once computed


def kv_device_backend(tensor, token: str) -> DeviceBackend | None:
    """The backend driving the GPU a KV tensor is on; None for KV in host memory."""
    if tensor.device.type != "cuda":
        return None
    import torch

    return backend_for(MemoryDevice.of_tensor(tensor), token, torch.cuda.current_stream(tensor.device))


class PDWorker:
    def __init__(self, config: ConnectorConfig, model_fingerprint: dict, groups: KvGroups = ONE_GROUP,
                 device_backend: Callable[[object, str], DeviceBackend | None] = kv_device_backend):
        """`device_backend(tensor, token)`: the device backend for KV like `tensor`, None for host
        KV (tests stand CPU tensors in for a GPU's with CpuStandIn)."""
        self._ranks = Ranks.from_wire(model_fingerprint.get("tp", SINGLE.to_wire()))
        self._heads_known = "tp" in model_fingerprint
        # rank r of an instance listens on its configured ports + r (ranks.py: rank_address)
        config = replace(config, handshake_port=config.handshake_port + self._ranks.rank,
                         notify_port=config.notify_port + self._ranks.rank)
        self._config = config
        token = secrets.token_hex(4)
        self._token = token
        self.identity = f"{config.engine_id}/{os.getpid()}-{token}"
        self.incarnation = Incarnation.this_process(self.identity)
        self._rig = attach_rig(config)  # a test rig's hooks (pdserve/rigs.py); Rig() changes nothing
        self._device_backend = device_backend
        self._backend: DeviceBackend | None = None  # KV on a GPU: what drives it
        self._transport: Transport | None = None  # built at register_kv_caches
        self._host_proof = HostProof(token)
        self._client = Client(Codec(load_secret(config.secret_file), self.identity))
        self._servers: list[Server] = []
        self._kv = KvMemory(model_fingerprint, token, groups)
        self._engine: TransferEngine | None = None
        self._engine_lock = threading.Lock()  # the step's hooks and the idle pump take turns with the engine
        self._idle_pump: IdlePump | None = None
        self._step = StepFlags()
        self._stats = WorkerStats(config)
        self._decode_serving = DecodeServing.for_config(config)

    # ---- startup ---------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict) -> None:
        removed = sweep_stale_segments()
        if removed:
            logger.info("pdserve: removed %d shared-memory segments left by dead instances", len(removed))
        local_heads = self._ranks.local_heads if self._heads_known else None
        self._backend = self._device_backend(next(iter(kv_caches.values())), self._token)
        if self._backend is None:
            self._transport = build_transport(self._config.transport, self._rig.wrap_transport(ShmTransport()),
                                              self.identity, self._config.transfer_timeout, self._rig.wrap_transport)
            self._kv.register(kv_caches, self._transport, local_heads)
        else:
            self._transport = build_device_transport(
                self._config.transport, self._config.kv_buffer_device, self._backend, self.identity,
                self._config.transfer_timeout, self._token, self._rig.wrap_transport)
            self._kv.register_device(kv_caches, self._transport, local_heads)
        self._engine = TransferEngine(self._config, self._kv.layout, self._transport, self, self._handshake,
                                      self._ranks)
        self._idle_pump = IdlePump(self._engine.pump, self._engine_lock)
        self._idle_pump.start()
        if self._decode_serving is not None:
            self._decode_serving.start()
        host, codec = self._config.host_ip, self._client.codec
        self._servers = [
            Server(host, self._config.handshake_port, codec, self._serve, "pdserve-handshake"),
            Server(host, self._config.notify_port, codec, self._serve, "pdserve-notify"),
        ]
        layers = self._kv.layout.layers
        where = "in shared memory" if self._backend is None else f"on {self._backend.device} ({type(self._transport).__name__})"
        logger.info(
            "pdserve: %s %s (rank %d of %d) ready: %d layers, %d blocks of %d bytes per layer %s, "
            "fingerprint %s", self._config.role.name, self.identity, self._ranks.rank, self._ranks.size, len(layers),
            layers[0].num_blocks, layers[0].block_bytes, where, self._kv.fingerprint,
        )

    # ---- control plane (server threads) ----------------------------------------------------

    def _serve(self, envelope: Envelope):
        message = envelope.message
        if isinstance(message, HandshakeRequest):
            try:
                check_compatible(self._kv.fingerprint, message.fingerprint, envelope.sender)
            except IncompatiblePeerError as exc:
                logger.error("pdserve: refusing handshake: %s", exc)
                return HandshakeRefused(str(exc))
            peer_here = verify(HostClaim(message.host_proof, message.host_proof_digest)) is None
            return HandshakeReply(
                self.identity, self._kv.fingerprint,
                [d.to_wire() for d in self._transport.local_descriptors()], self._kv.layout.to_wire(),
                self.incarnation.pid, self.incarnation.start_time, self.incarnation.boot_id,
                self._transport.local_endpoint(peer_here), *self._host_proof.claim,
            )
        if isinstance(message, Ping):
            return Pong()
        if isinstance(message, TRANSFER_MESSAGES):
            self._rig.at(f"receive:{message.TAG}")
            if self._decode_serving is not None and isinstance(message, DecodeStatus):
                self._decode_serving.on_status(message)
            self._engine.on_message(envelope.sender, message)
        else:
            logger.warning("pdserve: ignoring a %s sent to a server port by %s", type(message).__name__, envelope.sender)
        return None

    def _handshake(self, address: PeerAddress) -> HandshakeResult:
        where = f"{address.host}:{address.handshake_port}"
        answered_by = ""  # the incarnation that answered, when it did: it stays reachable for a Release
        try:
            started = time.monotonic()
            envelope = self._client.exchange(
                address.host, address.handshake_port, HandshakeRequest(self.identity, self._kv.fingerprint, *self._host_proof.claim),
                self._config.handshake_timeout,
            )
            self._stats.on_handshake(time.monotonic() - started)  # answered, accepted or not
            reply, answered_by = envelope.message, envelope.sender
            if isinstance(reply, HandshakeRefused):
                raise IncompatiblePeerError(f"peer {where} refused the handshake: {reply.reason}")
            if not isinstance(reply, HandshakeReply):
                raise ProtocolError(f"peer {where} answered the handshake with {type(reply).__name__}")
            check_compatible(self._kv.fingerprint, reply.fingerprint, where)
            regions = tuple(RegionDescriptor.from_wire(r) for r in reply.regions)
            layout = KvLayout.from_wire(reply.layers, region_sizes={d.region_id: d.size for d in regions})
            if len(layout.layers) != len(self._kv.layout.layers):
                raise IncompatiblePeerError(f"peer {where} has {len(layout.layers)} KV layers, we have {len(self._kv.layout.layers)}")
            ranks = Ranks.from_wire(reply.fingerprint.get("tp", SINGLE.to_wire()))
            if ranks.total_heads != self._ranks.total_heads:
                raise IncompatiblePeerError(f"peer {where} counts {ranks.total_heads} KV heads, we count "
                                            f"{self._ranks.total_heads}")
            if ranks.size != self._ranks.size and not self._kv.head_major:
                raise IncompatiblePeerError(f"peer {where} runs tensor-parallel size {ranks.size}, we run "
                                            f"{self._ranks.size}, and our KV blocks are not head-major "
                                            f"({self._kv.fingerprint.get('kv_block_format')}): a head range of a "
                                            "block is not one range of bytes")
        except IncompatiblePeerError as exc:
            return HandshakeResult(address, error=str(exc), refused_by=answered_by)
        except PDServeError as exc:
            return HandshakeResult(address, error=str(exc))
        not_here = verify(HostClaim(reply.host_proof, reply.host_proof_digest))
        route = PeerRoute(not_here is None, reply.nixl_metadata, not_here or "")
        # pid and boot id prove a death only to a peer that shares our host (and PID namespace)
        incarnation = Incarnation(reply.engine_id, reply.pid, reply.start_time, reply.boot_id if route.same_host else "")
        return HandshakeResult(address, incarnation, regions, layout, route=route, ranks=ranks)

    def notify(self, address: PeerAddress, message, recipient: str) -> bool:
        def send(msg) -> bool:
            try:
                self._client.send(address.host, address.notify_port, msg, recipient=recipient)
                return True
            except PDServeError as exc:
                logger.error("pdserve: cannot notify %s:%d: %s", address.host, address.notify_port, exc)
                return False

        return self._rig.outgoing(message, send)

    def forget(self, address: PeerAddress) -> None:
        self._client.forget(address.host, address.notify_port)

    # ---- vLLM hooks (worker thread) ------------------------------------------------------

    @guarded()
    def bind(self, meta: StepPlan) -> None:
        with self._engine_lock:
            if self._idle_pump is not None:
                self._idle_pump.step_started()
            self._bind(meta)

    def _bind(self, meta: StepPlan) -> None:
        engine = self._engine
        engine.begin_step()
        for spec in meta.cancels:
            engine.cancel(spec)
        for spec in meta.holds:
            engine.add_hold(spec)
        for spec in meta.recvs:
            engine.add_recv(spec)
        for spec in meta.sends:
            engine.add_send(spec)
        for spec in meta.awaits:
            engine.await_decision(spec)
        if meta.load is not None and self._ranks.rank == 0:  # one voice per instance in placement
            engine.placement.publish_load(meta.load)
            if self._decode_serving is not None:
                self._decode_serving.on_own_load(meta.load)
        if meta.status is not None and self._ranks.rank == 0:
            engine.placement.publish_status(meta.status)
        self._stats.on_plan(meta)
        self._step = StepFlags(bool(meta.sends), meta.idle, meta.stages if engine.staging is not None else [])
        engine.pump()

    @guarded()
    def save_kv_layer(self, layer_name: str) -> None:
        index = self._kv.layer_index.get(layer_name)
        if self._step.sends and index is not None:  # a layer without KV cache of ours has nothing to send
            self._engine.pump()
            self._engine.layer_ready(index)
            self._rig.at(f"after_layer:{index}")

    @guarded()
    def wait_for_save(self) -> None:
        if self._step.sends:
            self._engine.all_layers_ready()
            self._step.sends = False
        if self._step.stages:
            self._stage(self._step.stages)
            self._step.stages = []

    def _stage(self, specs: list[StageSpec]) -> None:
        """P READ, host staging: copy the blocks of the holds this step computed into the host
        mirror, and wait for it: the step's output, which names them to D, leaves only after.
        Only a hold whose staging is known done answers D's read with ok (read_hold.py)."""
        try:
            batch = [ops for spec in specs for ops in self._kv.layout.local_ops(spec.block_ids)]
            handle = self._engine.staging.stage(batch, not_after=time.monotonic() + self._config.transfer_timeout)
            if not handle.wait(self._config.transfer_timeout + STAGE_SETTLE_S):
                error = "staging did not finish in time"
            else:
                error = handle.error if handle.status is TransferStatus.FAILED else None
        except Exception as exc:  # noqa: BLE001 - any failure fails the holds, never passes for staged
            error = f"{type(exc).__name__}: {exc}"
        for spec in specs:
            if error is None:
                self._engine.stage_succeeded(spec.transfer_id)
            else:
                self._engine.stage_failed(spec.transfer_id)
        if error is not None:
            logger.error("pdserve: cannot stage the held KV of %d requests in host memory: %s", len(specs), error)

    @guarded(Finished)
    def take_finished(self, finished_req_ids: set[str]) -> Finished:
        if self._engine is None:
            return Finished()
        with self._engine_lock:
            try:
                self._engine.pump(IDLE_WAIT_S if self._step.idle else 0.0)
                return self._engine.take_finished(finished_req_ids)
            finally:
                if self._idle_pump is not None:
                    self._idle_pump.step_ended()

    def take_news(self):
        if self._engine is None:
            return None
        with self._engine_lock:
            return self._engine.placement.take_news()

    def take_stats(self) -> dict | None:
        if self._engine is None:
            return None
        with self._engine_lock:
            return self._take_stats()

    def _take_stats(self) -> dict | None:
        serving = self._decode_serving.take_change() if self._decode_serving is not None else []
        rejected = sum(server.num_rejected for server in self._servers)
        return self._stats.take(self._engine, rejected, serving, self._transport)

    def shutdown(self) -> None:
        if self._decode_serving is not None:
            self._decode_serving.stop()
        if self._idle_pump is not None:
            self._idle_pump.close()
        for server in self._servers:
            server.close()
        self._servers = []
        self._client.close()  # first: it ends the handshakes in flight, which the engine's close joins
        if self._engine is not None:
            self._engine.close()
        if self._transport is not None:
            self._transport.close()
        if self._backend is not None:
            self._backend.close()
        self._host_proof.close()
        self._kv.close()
