"""The worker half of PDConnector: owns the KV memory, the control-plane servers and the transport.

It runs in vLLM's worker process. At `register_kv_caches` it moves the KV cache into shared
memory in place and starts two control-plane servers (handshake, notify) bound to the configured
host. Each step it hands the scheduler's decisions and the forward pass's progress to the
`TransferEngine`, and reports finished transfers back.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import secrets
import threading
import time
from collections import deque

from pdserve.config import ConnectorConfig
from pdserve.config import Role
from pdserve.connector.engine import Finished, TransferEngine
from pdserve.connector.guard import guarded
from pdserve.connector.idle_pump import IdlePump
from pdserve.connector.incarnation import Incarnation
from pdserve.connector.layout import KvLayout, LayerPlacement, check_compatible, cpu_isa
from pdserve.connector.metadata import StepPlan
from pdserve.connector.peers import HandshakeResult
from pdserve.connector.registration import RouterRegistration
from pdserve.control.address import PeerAddress
from pdserve.control.codec import Codec, Envelope
from pdserve.control.endpoint import Client, Server
from pdserve.control.messages import (HandshakeRefused, HandshakeReply, HandshakeRequest, Ping, Pong, ReadAck, ReadDone,
                                      Release, RemoteBlocks, WriteDone)
from pdserve.control.secret import load_secret
from pdserve.errors import IncompatiblePeerError, PDServeError, ProtocolError
from pdserve.placement.messages import DecodeStatus, PrefillLoad
from pdserve.placement.serve_gate import ServeGate
from pdserve.rigs import attach_rig
from pdserve.transport.base import RegionDescriptor
from pdserve.transport.nixl_auto import PeerRoute, build_transport
from pdserve.transport.nixl_host import HostClaim, HostProof, verify
from pdserve.transport.shared_segment import sweep_stale_segments
from pdserve.transport.shm import ShmTransport
from pdserve.transport.shm_tensor import move_tensors_to_shared_memory

logger = logging.getLogger("pdserve.connector")

IDLE_WAIT_S = 0.002  # an empty engine step waits this long for transfer progress
# what the engine handles (every message but the handshake's and the liveness ping's)
TRANSFER_MESSAGES = (RemoteBlocks, WriteDone, Release, ReadDone, ReadAck, PrefillLoad, DecodeStatus)


class PDWorker:
    def __init__(self, config: ConnectorConfig, model_fingerprint: dict):
        self._config = config
        self._token = secrets.token_hex(4)
        self.identity = f"{config.engine_id}/{os.getpid()}-{self._token}"
        self.incarnation = Incarnation.this_process(self.identity)
        self._codec = Codec(load_secret(config.secret_file), self.identity)
        self._rig = attach_rig(config)  # a test rig's hooks (pdserve/rigs.py); Rig() changes nothing
        self._transport = build_transport(config.transport, self._rig.wrap_transport(ShmTransport()), self.identity,
                                          config.transfer_timeout, self._rig.wrap_transport)
        self._host_proof = HostProof(self._token)
        self._client = Client(self._codec)
        self._model_fingerprint = model_fingerprint
        self._fingerprint: dict = {}
        self._layer_index: dict[str, int] = {}
        self._segments: list = []
        self._servers: list[Server] = []
        self._engine: TransferEngine | None = None
        self._engine_lock = threading.Lock()  # the step's hooks and the idle pump take turns with the engine
        self._idle_pump: IdlePump | None = None
        self._step_sends = False
        self._idle = False
        self._reported_rejections = 0
        self._handshake_seconds: deque[float] = deque()  # appended by handshake threads, drained by take_stats
        self._placements: list[str] = []  # D: this interval's placement decisions, "placement:reason"
        self._chunk_steps: list[str] = []  # D: this interval's steps with a local chunk, "within"/"over" their bound
        self._remote_paths: list[float] = []  # D: this interval's measured remote paths (remote_path.py)
        self._prefill_queue: list[int] = []  # P: queued prompt tokens it published, latest last
        # P, serve_decode: registered as a decode instance too while D's streams are loaded (serve_gate.py)
        self._serve_gate = (ServeGate(config.placement.stream_itl_s)
                            if config.role is Role.PRODUCER and config.placement.serve_decode else None)
        self._decode_registration: RouterRegistration | None = None
        self._reported_serving: bool | None = None

    # ---- startup ---------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict) -> None:
        removed = sweep_stale_segments()
        if removed:
            logger.info("pdserve: removed %d shared-memory segments left by dead instances", len(removed))
        placements = move_tensors_to_shared_memory(kv_caches, self._token)
        region_ids: dict[int, int] = {}
        layers = []
        for index, (name, tensor) in enumerate(kv_caches.items()):
            if not tensor.is_contiguous():
                raise PDServeError(f"KV cache of {name} is not contiguous; PDConnector needs block-contiguous KV")
            placement = placements[name]
            segment = placement.segment
            if id(segment) not in region_ids:
                region_ids[id(segment)] = len(region_ids)
                # From here on the segment has no name: nothing can outlive this process.
                self._transport.register_region(region_ids[id(segment)], segment.address, segment.size,
                                                segment.unlink_name())
                self._segments.append(segment)
            block_bytes = tensor.stride(0) * tensor.element_size()
            layers.append(LayerPlacement(region_ids[id(segment)], placement.byte_offset, block_bytes, tensor.shape[0]))
            self._layer_index[name] = index
        first = next(iter(kv_caches.values()))
        shapes = "|".join(f"{name}:{t.dtype}:{list(t.shape)}:{t.stride(0)}" for name, t in kv_caches.items())
        self._fingerprint = {
            **self._model_fingerprint,
            "kv_dtype": str(first.dtype),
            "kv_block_shape": list(first.shape[1:]),
            "kv_layers": hashlib.sha256("|".join(kv_caches).encode()).hexdigest()[:16],
            "kv_layer_shapes": hashlib.sha256(shapes.encode()).hexdigest()[:16],
            "kv_regions": [layer.region_id for layer in layers],
            "cpu_isa": cpu_isa(),
        }
        self._layout = KvLayout(tuple(layers))
        self._engine = TransferEngine(self._config, self._layout, self._transport, self, self._handshake)
        self._idle_pump = IdlePump(self._engine.pump, self._engine_lock)
        self._idle_pump.start()
        if self._serve_gate is not None and self._config.proxy_ip:
            self._decode_registration = RouterRegistration(self._config, Role.CONSUMER, self._serve_gate.is_open)
        host = self._config.host_ip
        self._servers = [
            Server(host, self._config.handshake_port, self._codec, self._serve, "pdserve-handshake"),
            Server(host, self._config.notify_port, self._codec, self._serve, "pdserve-notify"),
        ]
        logger.info(
            "pdserve: %s %s ready: %d layers, %d blocks of %d bytes per layer in shared memory, fingerprint %s",
            self._config.role.name, self.identity, len(layers), layers[0].num_blocks, layers[0].block_bytes,
            self._fingerprint,
        )

    # ---- control plane (server threads) ----------------------------------------------------

    def _serve(self, envelope: Envelope):
        message = envelope.message
        if isinstance(message, HandshakeRequest):
            try:
                check_compatible(self._fingerprint, message.fingerprint, envelope.sender)
            except IncompatiblePeerError as exc:
                logger.error("pdserve: refusing handshake: %s", exc)
                return HandshakeRefused(str(exc))
            peer_here = verify(HostClaim(message.host_proof, message.host_proof_digest)) is None
            return HandshakeReply(
                self.identity, self._fingerprint,
                [d.to_wire() for d in self._transport.local_descriptors()], self._layout.to_wire(),
                self.incarnation.pid, self.incarnation.start_time, self.incarnation.boot_id,
                self._transport.local_endpoint(peer_here), *self._host_proof.claim,
            )
        if isinstance(message, Ping):
            return Pong()
        if isinstance(message, TRANSFER_MESSAGES):
            self._rig.at(f"receive:{message.TAG}")
            if self._serve_gate is not None and isinstance(message, DecodeStatus):
                self._serve_gate.on_status(message)
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
                address.host, address.handshake_port, HandshakeRequest(self.identity, self._fingerprint, *self._host_proof.claim),
                self._config.handshake_timeout,
            )
            self._handshake_seconds.append(time.monotonic() - started)  # answered, accepted or not
            reply, answered_by = envelope.message, envelope.sender
            if isinstance(reply, HandshakeRefused):
                raise IncompatiblePeerError(f"peer {where} refused the handshake: {reply.reason}")
            if not isinstance(reply, HandshakeReply):
                raise ProtocolError(f"peer {where} answered the handshake with {type(reply).__name__}")
            check_compatible(self._fingerprint, reply.fingerprint, where)
            regions = tuple(RegionDescriptor.from_wire(r) for r in reply.regions)
            layout = KvLayout.from_wire(reply.layers, region_sizes={d.region_id: d.size for d in regions})
            if len(layout.layers) != len(self._layout.layers):
                raise IncompatiblePeerError(f"peer {where} has {len(layout.layers)} KV layers, we have {len(self._layout.layers)}")
        except IncompatiblePeerError as exc:
            return HandshakeResult(address, error=str(exc), refused_by=answered_by)
        except PDServeError as exc:
            return HandshakeResult(address, error=str(exc))
        not_here = verify(HostClaim(reply.host_proof, reply.host_proof_digest))
        route = PeerRoute(not_here is None, reply.nixl_metadata, not_here or "")
        # pid and boot id prove a death only to a peer that shares our host (and PID namespace)
        incarnation = Incarnation(reply.engine_id, reply.pid, reply.start_time, reply.boot_id if route.same_host else "")
        return HandshakeResult(address, incarnation, regions, layout, route=route)

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
        if meta.load is not None:
            engine.publish_load(meta.load)
            if self._serve_gate is not None:
                self._serve_gate.on_own_load(meta.load)
            if not self._prefill_queue or self._prefill_queue[-1] != meta.load.queued_tokens:
                self._prefill_queue.append(meta.load.queued_tokens)
        if meta.status is not None:
            engine.publish_status(meta.status)
        self._placements.extend(meta.placements)
        self._chunk_steps.extend(meta.chunk_steps)
        self._remote_paths.extend(meta.remote_paths)
        self._step_sends = bool(meta.sends)
        self._idle = meta.idle
        engine.pump()

    @guarded()
    def save_kv_layer(self, layer_name: str) -> None:
        index = self._layer_index.get(layer_name)
        if self._step_sends and index is not None:  # a layer without KV cache of ours has nothing to send
            self._engine.pump()
            self._engine.layer_ready(index)
            self._rig.at(f"after_layer:{index}")

    @guarded()
    def wait_for_save(self) -> None:
        if self._step_sends:
            self._engine.all_layers_ready()
            self._step_sends = False

    @guarded(Finished)
    def take_finished(self, finished_req_ids: set[str]) -> Finished:
        if self._engine is None:
            return Finished()
        with self._engine_lock:
            try:
                self._engine.pump(IDLE_WAIT_S if self._idle else 0.0)
                return self._engine.take_finished(finished_req_ids)
            finally:
                if self._idle_pump is not None:
                    self._idle_pump.step_ended()

    def take_news(self):
        if self._engine is None:
            return None
        with self._engine_lock:
            return self._engine.take_news()

    def take_stats(self) -> dict | None:
        if self._engine is None:
            return None
        with self._engine_lock:
            return self._take_stats()

    def _take_stats(self) -> dict | None:
        stats = self._engine.stats
        rejected = sum(server.num_rejected for server in self._servers)
        new_rejections, self._reported_rejections = rejected - self._reported_rejections, rejected
        handshakes = [self._handshake_seconds.popleft() for _ in range(len(self._handshake_seconds))]
        placements, self._placements = self._placements, []
        chunk_steps, self._chunk_steps = self._chunk_steps, []
        remote_paths, self._remote_paths = self._remote_paths, []
        queue, self._prefill_queue = self._prefill_queue[-1:], []
        serving = []
        if self._serve_gate is not None and self._serve_gate.open != self._reported_serving:
            self._reported_serving = self._serve_gate.open
            serving = [int(self._reported_serving)]
        if not (stats.num_completed or stats.num_failed or new_rejections or handshakes or placements or queue
                or serving or chunk_steps or remote_paths):
            return None
        self._engine.stats = type(stats)()
        recomputed = stats.num_failed if self._config.role is Role.CONSUMER and self._config.load_failure_policy == "recompute" else 0
        return {**dataclasses.asdict(stats), "num_rejected": new_rejections, "num_recomputed": recomputed,
                "handshake_seconds": handshakes, "placements": placements, "prefill_queued_tokens": queue,
                "serving_decode": serving, "chunk_steps": chunk_steps, "remote_paths": remote_paths,
                "peers_attached": self._transport.take_attached()}

    def shutdown(self) -> None:
        if self._decode_registration is not None:
            self._decode_registration.stop()
            self._decode_registration = None
        if self._idle_pump is not None:
            self._idle_pump.close()
        for server in self._servers:
            server.close()
        self._servers = []
        self._client.close()  # first: it ends the handshakes in flight, which the engine's close joins
        if self._engine is not None:
            self._engine.close()
        self._transport.close()
        self._host_proof.close()
        for segment in self._segments:
            segment.close()
        self._segments = []
