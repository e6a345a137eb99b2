"""ZMQ endpoints of the control plane: a Server thread (ROUTER) and a Client (DEALERs).

Every frame goes through the Codec: the server drops (and counts) anything that fails to decode
and keeps serving; a handler may answer a request with a reply message.
"""

from __future__ import annotations

import errno
import logging
import threading
from collections.abc import Callable

import zmq

from pdserve.control.codec import Codec, Envelope
from pdserve.errors import AddressInUseError, ConfigError, HandshakeError, PDServeError, TransferError

logger = logging.getLogger(__name__)

Handler = Callable[[Envelope], object | None]

_POLL_MS = 50
_JOIN_DEADLINE_S = 2.0
_SEND_HWM = 1000
_SEND_TIMEOUT_MS = 1000
_LINGER_MS = 200


def tcp_endpoint(host: str, port: int) -> str:
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


class Server:
    """Receives control messages on `tcp://bind_host:port` and hands them to `handler`.

    Binds in the constructor (so a taken port raises AddressInUseError at once; port 0 picks a
    free port, see `.port`) and serves on a daemon thread until `close()`. `handler` runs on that
    thread; what it returns (a message or None) is sent back to the sender.
    """

    def __init__(self, bind_host: str, port: int, codec: Codec, handler: Handler, name: str = "control"):
        if bind_host in ("0.0.0.0", "::", "*", ""):
            logger.warning("%s server binds every interface (%r) as asked", name, bind_host)
        self.name = name
        self.codec = codec
        self.handler = handler
        self.num_rejected = 0
        self.num_handled = 0
        self.num_handler_errors = 0
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.ROUTER_HANDOVER, 1)
        if ":" in bind_host:
            self._socket.setsockopt(zmq.IPV6, 1)
        try:
            self._socket.bind(tcp_endpoint(bind_host, port))
        except zmq.ZMQError as e:
            self._socket.close(0)
            self._context.term()
            if e.errno == errno.EADDRINUSE:
                raise AddressInUseError(f"{name} server cannot bind {bind_host}:{port}: address already in use") from None
            raise ConfigError(f"{name} server cannot bind {bind_host}:{port}: {e}") from None
        self.host = bind_host
        self.port = int(self._socket.getsockopt(zmq.LAST_ENDPOINT).decode().rsplit(":", 1)[1])
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name=f"pdserve-{name}-server", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop serving, join the thread (with a deadline), close the socket and context. Idempotent."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join(_JOIN_DEADLINE_S)
        if self._thread.is_alive():
            logger.error("%s server thread did not stop within %.0f s (stuck in its handler?)", self.name, _JOIN_DEADLINE_S)
            return
        self._socket.close(0)
        self._context.term()

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(_POLL_MS):
                continue
            try:
                frames = self._socket.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                continue
            except zmq.ZMQError as e:
                if self._stop.is_set():
                    return
                logger.error("%s server receive failed: %s", self.name, e)
                continue
            self._handle(frames)

    def _handle(self, frames: list[zmq.Frame]) -> None:
        peer = _peer_address(frames[-1])
        if len(frames) != 2:
            self._reject(peer, f"expected [identity, frame], got {len(frames)} frames")
            return
        identity, frame = frames
        try:
            envelope = self.codec.decode(frame.bytes)
        except PDServeError as e:
            self._reject(peer, str(e))
            return
        try:
            reply = self.handler(envelope)
        except Exception:  # noqa: BLE001 - one bad message must not stop the server
            self.num_handler_errors += 1
            logger.exception("%s server: handler failed on %s from %s", self.name, type(envelope.message).__name__, envelope.sender)
            return
        self.num_handled += 1
        if reply is not None:
            try:
                self._socket.send_multipart([identity.bytes, self.codec.encode(reply)], zmq.NOBLOCK)
            except zmq.ZMQError as e:
                logger.warning("%s server: cannot reply to %s: %s", self.name, envelope.sender, e)

    def _reject(self, peer: str, reason: str) -> None:
        self.num_rejected += 1
        logger.warning("%s server rejected a message from %s: %s", self.name, peer, reason)


class Client:
    """Sends control messages: `request` waits for a reply, `send` is fire-and-forget.

    Thread-safe (one lock around the cached sockets). `close()` closes every socket.
    """

    def __init__(self, codec: Codec):
        self.codec = codec
        self._context = zmq.Context()
        self._senders: dict[tuple[str, int], zmq.Socket] = {}
        self._lock = threading.Lock()
        self._closed = False

    def request(self, host: str, port: int, msg, timeout_s: float):
        """Send `msg` and return the decoded reply message.

        Raises HandshakeError when no reply arrives within `timeout_s`, ProtocolError or
        AuthenticationError when the reply does not decode.
        """
        socket = self._context.socket(zmq.DEALER)
        try:
            socket.setsockopt(zmq.LINGER, 0)
            if ":" in host:
                socket.setsockopt(zmq.IPV6, 1)
            socket.connect(tcp_endpoint(host, port))
            socket.send(self.codec.encode(msg), zmq.NOBLOCK)
            if not socket.poll(int(timeout_s * 1000), zmq.POLLIN):
                raise HandshakeError(f"no reply from {host}:{port} to {type(msg).__name__} within {timeout_s:g} s")
            return self.codec.decode(socket.recv()).message
        except zmq.ZMQError as e:
            raise HandshakeError(f"request to {host}:{port} failed: {e}") from None
        finally:
            socket.close(0)

    def send(self, host: str, port: int, msg) -> None:
        """Queue `msg` for the peer and return; TransferError if the peer's queue stays full
        (peer gone or too slow) for the send deadline."""
        frame = self.codec.encode(msg)
        with self._lock:
            if self._closed:
                raise TransferError("control client is closed")
            socket = self._sender(host, port)
            try:
                socket.send(frame)
            except zmq.Again:
                raise TransferError(
                    f"cannot send {type(msg).__name__} to {host}:{port}: queue full for {_SEND_TIMEOUT_MS} ms"
                ) from None

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for socket in self._senders.values():
                socket.close(_LINGER_MS)
            self._senders.clear()
        self._context.term()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def _sender(self, host: str, port: int) -> zmq.Socket:
        socket = self._senders.get((host, port))
        if socket is None:
            socket = self._context.socket(zmq.DEALER)
            socket.setsockopt(zmq.LINGER, _LINGER_MS)
            socket.setsockopt(zmq.SNDHWM, _SEND_HWM)
            socket.setsockopt(zmq.SNDTIMEO, _SEND_TIMEOUT_MS)
            socket.setsockopt(zmq.RCVHWM, 16)
            if ":" in host:
                socket.setsockopt(zmq.IPV6, 1)
            socket.connect(tcp_endpoint(host, port))
            self._senders[(host, port)] = socket
        return socket


def _peer_address(frame: zmq.Frame) -> str:
    try:
        return frame.get("Peer-Address")
    except (zmq.ZMQError, AttributeError, TypeError):
        return "unknown peer"
