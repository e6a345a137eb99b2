"""The registrar's socket work: signed registrations in, the router's discovery map out."""

from __future__ import annotations

import logging

import msgpack
import zmq

from pdserve.control.codec import Codec
from pdserve.control.endpoint import Server, tcp_endpoint
from pdserve.control.limits import MAX_REGISTRATION_FRAME_BYTES
from pdserve.control.registration import Registration
from pdserve.registrar.spec import LOOPBACK

logger = logging.getLogger("pdserve.registrar")

SENDER_ID = "registrar"
_ROUTER_HWM = 1000


class Registrar:
    """Receives registrations on `listen_host`:`listen_port` and forwards each authentic one to
    vllm-router's discovery socket at LOOPBACK:`router_port`.

    Binds in the constructor (AddressInUseError or ConfigError at once) and serves on the control
    Server's thread until `close()`. Frames that fail the codec's checks are counted in
    `num_rejected` and logged, rate-limited, by that server; authentic messages of another type are
    counted in `num_ignored`; a registration the router's socket cannot take now (router starting
    or restarting) in `num_undeliverable` (the instance sends the next one within a second).
    """

    def __init__(self, listen_host: str, listen_port: int, router_port: int, secret: bytes, max_skew_s: float = 30.0):
        self.num_forwarded = 0
        self.num_ignored = 0
        self.num_undeliverable = 0
        self._known: set[tuple[str, str]] = set()  # (type, http_address) logged once each
        self._context = zmq.Context()
        self._router = self._context.socket(zmq.DEALER)  # used only from the server's thread
        self._router.setsockopt(zmq.LINGER, 0)
        self._router.setsockopt(zmq.SNDHWM, _ROUTER_HWM)
        self._router.setsockopt(zmq.IMMEDIATE, 1)
        self._router.connect(tcp_endpoint(LOOPBACK, router_port))
        try:
            self._server = Server(listen_host, listen_port, Codec(secret, SENDER_ID, max_skew_s), self._forward,
                                  name="registrar", max_frame_bytes=MAX_REGISTRATION_FRAME_BYTES)
        except BaseException:
            self._router.close(0)
            self._context.term()
            raise

    @property
    def port(self) -> int:
        return self._server.port

    @property
    def num_rejected(self) -> int:
        return self._server.num_rejected

    def close(self) -> None:
        """Stop serving, then close the router's socket. Idempotent."""
        self._server.close()
        if not self._router.closed:
            self._router.close(0)
            self._context.term()

    def _forward(self, envelope) -> None:
        registration = envelope.message
        if not isinstance(registration, Registration):
            self.num_ignored += 1
            logger.debug("registrar ignored a %s from %s", type(registration).__name__, envelope.sender)
            return
        try:
            self._router.send(msgpack.packb(registration.router_map(), use_bin_type=True), zmq.NOBLOCK)
        except zmq.Again:
            self.num_undeliverable += 1
            logger.debug("registrar: the router's discovery socket does not take registrations yet")
            return
        self.num_forwarded += 1
        key = (registration.type, registration.http_address)
        if key not in self._known:
            self._known.add(key)
            logger.info("registrar forwards %s instance %s (%s, %s) from %s", registration.type,
                        registration.http_address, registration.zmq_address, registration.transfer_mode, envelope.sender)
