"""The worker half of PDConnector: owns the KV memory, the control-plane servers and the transport.

It runs in vLLM's worker process. At `register_kv_caches` it builds the transport for where the
KV cache is (kv_transport.py) and starts two control-plane servers (handshake, notify) bound to
the configured host; the handshake, both ways, is handshake.py's. Each step it hands the
scheduler's decisions and the forward pass's progress to the `TransferEngine`, and reports
finished transfers back.
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
from pdserve.connector.worker.handshake import Handshake
from pdserve.connector.worker.idle_pump import IdlePump
from pdserve.connector.worker.kv_memory import KvMemory
from pdserve.connector.worker.kv_transport import KvTransport, kv_device_backend
from pdserve.connector.worker.worker_stats import WorkerStats
from pdserve.control.address import PeerAddress
from pdserve.control.codec import Codec, Envelope
from pdserve.control.endpoint import Client, Server
from pdserve.control.messages import HandshakeRequest, Ping, Pong, ReadAck, ReadDone, Release, RemoteBlocks, WriteDone
from pdserve.control.secret import load_secret
from pdserve.errors import PDServeError
from pdserve.placement import DecodeStatus, PrefillLoad
from pdserve.rigs import attach_rig
from pdserve.transfer.engine import Finished, TransferEngine
from pdserve.transfer.ranks import SINGLE, Ranks
from pdserve.transport.base import TransferStatus, Transport
from pdserve.transport.device_backend import DeviceBackend

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


class PDWorker:
    def __init__(self, config: ConnectorConfig, model_fingerprint: dict, groups: KvGroups = ONE_GROUP,
                 device_backend: Callable[[object, str], DeviceBackend | None] = kv_device_backend):
        """`device_backend(tensor, token)`: the device backend for KV like `tensor`, None for host
        KV (tests stand CPU tensors in for a GPU's with CpuStandIn)."""
        self._ranks = Ranks.from_wire(model_fingerprint.get("tp", SINGLE.to_wire()))
        # rank r of an instance listens on its configured ports + r (ranks.py: rank_address)
        config = replace(config, handshake_port=config.handshake_port + self._ranks.rank,
                         notify_port=config.notify_port + self._ranks.rank)
        self._config = config
        token = secrets.token_hex(4)
        self._rig = attach_rig(config)  # a test rig's hooks (pdserve/rigs.py); Rig() changes nothing
        local_heads = self._ranks.local_heads if "tp" in model_fingerprint else None
        self._kv_transport = KvTransport(device_backend, token, local_heads)  # built at register_kv_caches
        self._kv = KvMemory(model_fingerprint, token, groups)
        self._stats = WorkerStats(config)
        identity = f"{config.engine_id}/{os.getpid()}-{token}"
        self._client = Client(Codec(load_secret(config.secret_file), identity))
        self._handshake = Handshake(config, identity, token, self._ranks, self._kv, self._client, self._stats)
        self._servers: list[Server] = []
        self._engine: TransferEngine | None = None
        self._engine_lock = threading.Lock()  # the step's hooks and the idle pump take turns with the engine
        self._idle_pump: IdlePump | None = None
        self._step = StepFlags()
        self._decode_serving = DecodeServing.for_config(config)

    @property
    def identity(self) -> str:
        return self._handshake.identity

    @property
    def _transport(self) -> Transport | None:
        return self._kv_transport.transport

    # ---- startup ---------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict) -> None:
        transport = self._kv_transport.build(kv_caches, self._kv, self._config, self.identity, self._rig)
        self._engine = TransferEngine(self._config, self._kv.layout, transport, self, self._handshake.meet,
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
        logger.info(
            "pdserve: %s %s (rank %d of %d) ready: %d layers, %d blocks of %d bytes per layer %s, "
            "fingerprint %s", self._config.role.name, self.identity, self._ranks.rank, self._ranks.size, len(layers),
            layers[0].num_blocks, layers[0].block_bytes, self._kv_transport.where(), self._kv.fingerprint,
        )

    # ---- control plane (server threads) ----------------------------------------------------

    def _serve(self, envelope: Envelope):
        message = envelope.message
        if isinstance(message, HandshakeRequest):
            return self._handshake.answer(message, envelope.sender, self._transport)
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
        self._kv_transport.close()
        self._handshake.close()
        self._kv.close()
