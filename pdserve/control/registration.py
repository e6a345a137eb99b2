"""Registration heartbeats to vllm-router's service discovery (its ZMQ ROUTER socket).

vllm-router 0.1.17 expects a msgpack map per message: `type` "P"/"D", `http_address`
"host:port", `zmq_address` "host:<ip>,handshake:<port>,notify:<port>", `transfer_mode`
"READ"/"WRITE" (MoRIIO mode). It never answers and forgets an instance 5 s after its last
message, so we re-send every `interval_s` from our own thread.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import msgpack
import zmq

from pdserve.control.endpoint import tcp_endpoint

logger = logging.getLogger(__name__)

_JOIN_DEADLINE_S = 2.0


class RegistrationHeartbeat:
    """Sends `payload` to the router every `interval_s` seconds from a daemon thread, starting
    at once, until `stop()`. Messages that cannot be queued (router down) are dropped: the next
    beat tries again. With `when`, a beat is sent only while `when()` is true (the router forgets
    the instance ~5 s after the last one)."""

    def __init__(self, router_host: str, router_port: int, payload: dict, interval_s: float = 1.0,
                 when: Callable[[], bool] | None = None):
        if not isinstance(payload, dict):
            raise TypeError(f"registration payload must be a dict, got {type(payload).__name__}")
        self.router = tcp_endpoint(router_host, router_port)
        self.interval_s = interval_s
        self.num_sent = 0
        self._when = when
        self._frame = msgpack.packb(payload, use_bin_type=True)
        self._context = zmq.Context()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pdserve-registration", daemon=True)
        self._thread.start()

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
        if self.router.startswith("tcp://["):
            socket.setsockopt(zmq.IPV6, 1)
        socket.connect(self.router)
        try:
            while not self._stop.is_set():
                if self._due():
                    try:
                        socket.send(self._frame, zmq.NOBLOCK)
                        self.num_sent += 1
                    except zmq.Again:
                        logger.debug("registration to %s not queued (router unreachable?)", self.router)
                self._stop.wait(self.interval_s)
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
