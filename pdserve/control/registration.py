"""Registration with vllm-router's service discovery, signed by the deployment's secret.

vllm-router 0.1.17 expects a msgpack map per message on its discovery (ZMQ ROUTER) socket: `type`
"P"/"D", `http_address` "host:port", `zmq_address` "host:<ip>,handshake:<port>,notify:<port>",
`transfer_mode` "READ"/"WRITE" (MoRIIO mode). It never answers and forgets an instance 5 s after its
last message, so we re-send every `interval_s` from our own thread.

That socket authenticates nothing, so instances never talk to it: they send a `Registration`
through the control codec (HMAC over the deployment's secret, timestamp, nonce) to pdserve's
registrar on the router's host (pdserve/registrar/), which checks it and hands
`router_map()` to the router's socket, bound to loopback there. A registrar that refuses our
registrations because the two clocks differ by more than the skew window says so (a ClockSkew
notice), and the heartbeat logs it here with the measured offset (clock_skew.py).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

import zmq

from pdserve.control.address import check_host, parse_zmq_address
from pdserve.control.clock_skew import SkewNotices
from pdserve.control.codec import Codec
from pdserve.control.endpoint import tcp_endpoint
from pdserve.control.limits import MAX_NOTICE_FRAME_BYTES, NOTICE_QUEUE
from pdserve.control.messages import check, message
from pdserve.errors import ProtocolError

logger = logging.getLogger(__name__)

_JOIN_DEADLINE_S = 2.0
ROLES = ("P", "D")
TRANSFER_MODES = ("READ", "WRITE")
MAX_PARALLEL = 1024  # tp_size, dp_size


@message("registration")
@dataclass(frozen=True)
class Registration:
    """Instance -> registrar: register me with the router as a prefill ("P") or decode ("D")
    instance. The fields are the router's discovery map, key for key (`router_map`)."""

    ADDRESSED = False
    type: str
    http_address: str
    zmq_address: str
    transfer_mode: str
    tp_size: int = 1
    dp_size: int = 1

    def validate(self) -> None:
        check(self.type in ROLES, type(self), f"type must be P or D, got {self.type[:20]!r}")
        check(self.transfer_mode in TRANSFER_MODES, type(self),
              f"transfer_mode must be READ or WRITE, got {self.transfer_mode[:20]!r}")
        check(0 < self.tp_size <= MAX_PARALLEL and 0 < self.dp_size <= MAX_PARALLEL, type(self),
              f"tp_size and dp_size must be 1..{MAX_PARALLEL}")
        host, sep, port = self.http_address.rpartition(":")
        check(bool(sep) and port.isdigit() and len(port) <= 5 and 0 < int(port) < 65536, type(self),
              f"http_address must be host:port, got {self.http_address[:80]!r}")
        try:
            check_host(host.strip("[]"), "registration http_address")
            parse_zmq_address(self.zmq_address)
        except ProtocolError as e:
            raise ProtocolError(f"{self.TAG}: {e}") from None

    def router_map(self) -> dict:
        """The map vllm-router's discovery socket takes."""
        return dataclasses.asdict(self)


class RegistrationHeartbeat:
    """Signs `registration` with `codec` and sends it to the registrar every `interval_s` seconds
    from a daemon thread, starting at once, until `stop()`; every beat is a fresh frame (its own
    timestamp and nonce). A beat that cannot be queued (registrar down) is dropped: the next one
    tries again. With `when`, a beat is sent only while `when()` is true (the router forgets the
    instance ~5 s after the last one). A registrar that refuses the beats for the clocks' skew says
    so; it is logged, and the offset kept in `clock_offset_s`."""

    def __init__(self, registrar_host: str, registrar_port: int, registration: Registration, codec: Codec,
                 interval_s: float = 1.0, when: Callable[[], bool] | None = None):
        if not isinstance(registration, Registration):
            raise TypeError(f"registration must be a Registration, got {type(registration).__name__}")
        registration.validate()
        self.registrar = tcp_endpoint(registrar_host, registrar_port)
        self.registration = registration
        self.interval_s = interval_s
        self.num_sent = 0
        self._codec = codec
        self._skew = SkewNotices(codec)
        self._when = when
        self._context = zmq.Context()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pdserve-registration", daemon=True)
        self._thread.start()

    @property
    def clock_offset_s(self) -> float | None:
        """The registrar's clock minus ours, when it refused a beat for the skew; else None."""
        return self._skew.offsets.get(self._peer)

    @property
    def _peer(self) -> str:
        return f"the registrar at {self.registrar.removeprefix('tcp://')}"

    def stop(self) -> None:
        """Stop beating, join the thread (with a deadline), close socket and context. Idempotent."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join(_JOIN_DEADLINE_S)
        if self._thread.is_alive():
            logger.error("registration thread did not stop within %.0f s", _JOIN_DEADLINE_S)
            return
        self._context.term()

    def _run(self) -> None:
        socket = self._context.socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.SNDHWM, 4)
        socket.setsockopt(zmq.RCVHWM, NOTICE_QUEUE)
        socket.setsockopt(zmq.MAXMSGSIZE, MAX_NOTICE_FRAME_BYTES)
        socket.setsockopt(zmq.IMMEDIATE, 1)  # queue nothing before the registrar answers: no stale beats
        if self.registrar.startswith("tcp://["):
            socket.setsockopt(zmq.IPV6, 1)
        socket.connect(self.registrar)
        try:
            while not self._stop.is_set():
                if self._due():
                    try:
                        socket.send(self._codec.encode(self.registration), zmq.NOBLOCK)
                        self.num_sent += 1
                    except zmq.Again:
                        logger.debug("registration to %s not queued (registrar unreachable?)", self.registrar)
                self._stop.wait(self.interval_s)
                self._skew.read(socket, self._peer, "this instance's registrations (the router will not route to it)")
        finally:
            socket.close(0)

    def _due(self) -> bool:
        if self._when is None:
            return True
        try:
            return bool(self._when())
        except Exception:  # a failing predicate must not kill the heartbeat: skip this beat
            logger.exception("registration predicate failed")
            return False
