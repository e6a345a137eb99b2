"""ZMQ endpoints of the control plane: a Server thread (ROUTER) and a Client (DEALERs).

Every frame goes through the Codec: the server drops (and counts) anything that fails to decode
and keeps serving; a handler may answer a request with a reply message, addressed to the
request's sender. Every socket refuses frames above the bound of what it receives (limits.py:
ZMQ drops the connection before buffering such a frame), and queues only what its traffic needs.
A server answers an authentic frame refused for its timestamp with a ClockSkew notice, which the
client reads after its next send and logs with the measured offset (clock_skew.py).
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import zmq

from pdserve.control.clock_skew import SkewNotices
from pdserve.control.codec import ClockSkewError, Codec, Envelope
from pdserve.control.limits import (
    EXCHANGE_QUEUE,
    MAX_FRAME_BYTES,
    MAX_NOTICE_FRAME_BYTES,
    MAX_REQUEST_FRAME_BYTES,
    NOTICE_QUEUE,
    SEND_QUEUE,
    SERVER_RECEIVE_QUEUE,
    SERVER_REPLY_QUEUE,
)
from pdserve.control.messages import ClockSkew
from pdserve.control.ratelimit import RateLimitedWarnings
from pdserve.errors import AddressInUseError, ConfigError, HandshakeError, PDServeError, TransferError

logger = logging.getLogger(__name__)

Handler = Callable[[Envelope], object | None]

MAX_CACHED_SOCKETS = 256
IDLE_SOCKET_S = 300.0
_POLL_MS = 50
_JOIN_DEADLINE_S = 2.0
_LINGER_MS = 200
_exchanges = itertools.count()  # names each request's connection monitor


def tcp_endpoint(host: str, port: int) -> str:
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


class Server:
    """Receives control messages on `tcp://bind_host:port` and hands them to `handler`.

    Binds in the constructor (so a taken port raises AddressInUseError at once; port 0 picks a
    free port, see `.port`) and serves on a daemon thread until `close()`. `handler` runs on that
    thread; what it returns (a message or None) is sent back to the sender, addressed to it.
    Rejected frames are counted exactly (`num_rejected`) and logged rate-limited
    (`warn_burst` in full per `warn_interval_s`, then one summary line); an authentic one refused
    for its timestamp is answered with a ClockSkew notice. ZMQ drops a connection that sends a
    frame above `max_frame_bytes` (the largest message this server's handler takes) unread.
    """

    def __init__(self, bind_host: str, port: int, codec: Codec, handler: Handler, name: str = "control",
                 warn_burst: int = 5, warn_interval_s: float = 10.0, max_frame_bytes: int = MAX_REQUEST_FRAME_BYTES):
        if bind_host in ("0.0.0.0", "::", "*", ""):
            logger.warning("%s server binds every interface (%r) as asked", name, bind_host)
        self.name = name
        self.codec = codec
        self.handler = handler
        self.num_rejected = 0
        self.num_handled = 0
        self.num_handler_errors = 0
        self._warnings = RateLimitedWarnings(logger, f"{name} server rejected", warn_burst, warn_interval_s)
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        # No ROUTER_HANDOVER: a connection claiming a known routing id must not take over the
        # replies meant for the first one. Each request uses a fresh DEALER, so none needs it.
        self._socket.setsockopt(zmq.MAXMSGSIZE, min(max_frame_bytes, MAX_FRAME_BYTES))
        self._socket.setsockopt(zmq.RCVHWM, SERVER_RECEIVE_QUEUE)
        self._socket.setsockopt(zmq.SNDHWM, SERVER_REPLY_QUEUE)
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
            self._warnings.flush()
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
            self._reject(peer, "multipart message", f"expected [identity, frame], got {len(frames)} frames")
            return
        identity, frame = frames
        try:
            envelope = self.codec.decode(frame.bytes)
        except ClockSkewError as e:
            self._reject(peer, type(e).__name__, f"{e} (sender {e.sender!r})")
            self._send(identity, ClockSkew(e.offset_s), e.sender)
            return
        except PDServeError as e:
            self._reject(peer, type(e).__name__, str(e))
            return
        try:
            reply = self.handler(envelope)
        except Exception:  # noqa: BLE001 - one bad message must not stop the server
            self.num_handler_errors += 1
            logger.exception("%s server: handler failed on %s from %s", self.name, type(envelope.message).__name__, envelope.sender)
            return
        self.num_handled += 1
        if reply is not None and not self._send(identity, reply, envelope.sender):
            self.num_handler_errors += 1

    def _send(self, identity: zmq.Frame, reply, recipient: str) -> bool:
        try:
            frame = self.codec.encode(reply, recipient=recipient)
        except PDServeError as e:
            logger.error("%s server: cannot encode the %s reply to %s: %s", self.name, type(reply).__name__, recipient, e)
            return False
        try:
            self._socket.send_multipart([identity.bytes, frame], zmq.NOBLOCK)
        except zmq.ZMQError as e:
            logger.warning("%s server: cannot reply to %s: %s", self.name, recipient, e)
        return True

    def _reject(self, peer: str, reason: str, detail: str) -> None:
        self.num_rejected += 1
        self._warnings.warn(reason, f"a message from {peer}: {detail}")


@dataclass(slots=True)
class _CachedSocket:
    socket: zmq.Socket
    last_used: float  # time.monotonic() of the last send


class Client:
    """Sends control messages: `request` waits for a reply, `send` is fire-and-forget.

    `send` keeps one DEALER per peer address, least recently used first; sockets idle for longer
    than `max_idle_s` are closed on the next send, and at most `max_sockets` stay open. A peer that
    refuses our frames for their timestamps says so after the next send to it (logged, with the
    offset, in `skew.offsets`). Thread-safe (one lock around the cached sockets). `close()` closes
    every socket.
    """

    def __init__(self, codec: Codec, max_sockets: int = MAX_CACHED_SOCKETS, max_idle_s: float = IDLE_SOCKET_S):
        self.codec = codec
        self.max_sockets = max_sockets
        self.max_idle_s = max_idle_s
        self._context = zmq.Context()
        self._senders: OrderedDict[tuple[str, int], _CachedSocket] = OrderedDict()
        self.skew = SkewNotices(codec)
        self._lock = threading.Lock()
        self._closed = False

    @property
    def num_cached(self) -> int:
        """How many peer sockets `send` keeps open now."""
        with self._lock:
            return len(self._senders)

    def request(self, host: str, port: int, msg, timeout_s: float, recipient: str = ""):
        """Send `msg` (addressed to `recipient`, see Codec.encode) and return the decoded reply
        (`exchange` without the envelope)."""
        return self.exchange(host, port, msg, timeout_s, recipient).message

    def exchange(self, host: str, port: int, msg, timeout_s: float, recipient: str = "") -> Envelope:
        """Send `msg` (addressed to `recipient`, see Codec.encode) and return the reply's envelope.

        Raises HandshakeError when no reply arrives within `timeout_s`, or at once when the
        connection is refused (nothing listens there); ProtocolError or AuthenticationError when
        the reply does not decode (FencedError when it is addressed to someone else). A reply
        bigger than MAX_FRAME_BYTES is never buffered: ZMQ drops the connection, and the request
        times out. `close()` ends a request in flight at once.
        """
        frame = self.codec.encode(msg, recipient)
        with self._lock:
            if self._closed:
                raise HandshakeError("control client is closed")
            socket = self._context.socket(zmq.DEALER)
            refusals = socket.get_monitor_socket(zmq.EVENT_CONNECT_RETRIED, f"inproc://pdserve-exchange-{next(_exchanges)}")
        try:
            socket.setsockopt(zmq.LINGER, 0)
            socket.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
            socket.setsockopt(zmq.SNDHWM, EXCHANGE_QUEUE)
            socket.setsockopt(zmq.RCVHWM, EXCHANGE_QUEUE)
            if ":" in host:
                socket.setsockopt(zmq.IPV6, 1)
            socket.connect(tcp_endpoint(host, port))
            socket.send(frame, zmq.NOBLOCK)
            poller = zmq.Poller()
            poller.register(socket, zmq.POLLIN)
            poller.register(refusals, zmq.POLLIN)
            ready = dict(poller.poll(int(timeout_s * 1000)))
            if socket in ready:
                return self.codec.decode(socket.recv(zmq.NOBLOCK))
            no_reply = f"no reply from {host}:{port} to {type(msg).__name__} within {timeout_s:g} s"
            if refusals in ready:
                raise HandshakeError(f"{no_reply}: connection refused")  # none will come: fail now, not at the timeout
            raise HandshakeError(no_reply)
        except zmq.ZMQError as e:
            raise HandshakeError(f"request to {host}:{port} failed: {e}") from None
        finally:
            with contextlib.suppress(zmq.ZMQError):  # the context may be terminating
                socket.disable_monitor()
            refusals.close(0)
            socket.close(0)

    def send(self, host: str, port: int, msg, recipient: str = "") -> None:
        """Queue `msg` (addressed to `recipient`) for the peer and return at once; never blocks.

        TransferError at once when the peer's queue is full (peer gone or too slow: callers log
        or count it and move on) or the address is unusable.
        """
        frame = self.codec.encode(msg, recipient)
        with self._lock:
            if self._closed:
                raise TransferError("control client is closed")
            now = time.monotonic()
            self._evict_idle(now - self.max_idle_s)
            socket = self._sender(host, port, now)
            try:
                socket.send(frame, zmq.NOBLOCK)
            except zmq.Again:
                raise TransferError(
                    f"cannot send {type(msg).__name__} to {host}:{port}: {SEND_QUEUE} messages already queued "
                    "(peer gone or too slow)"
                ) from None
            except zmq.ZMQError as e:
                raise TransferError(f"cannot send {type(msg).__name__} to {host}:{port}: {e}") from None
            self.skew.read(socket, f"peer {host}:{port}", "this instance's control messages")

    def forget(self, host: str, port: int) -> bool:
        """Close the cached socket to `host:port`, dropping what is still queued there (the peer
        at that address is a new incarnation: nothing meant for the old one may reach it).
        Returns whether there was one."""
        with self._lock:
            cached = self._senders.pop((host, port), None)
        if cached is None:
            return False
        cached.socket.close(0)
        return True

    def evict_idle(self, max_idle_s: float) -> int:
        """Close the cached sockets unused for more than `max_idle_s`; returns how many."""
        with self._lock:
            return self._evict_idle(time.monotonic() - max_idle_s)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for cached in self._senders.values():
                cached.socket.close(_LINGER_MS)
            self._senders.clear()
        self._context.term()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def _evict_idle(self, used_before: float) -> int:
        num_evicted = 0
        while self._senders:
            key, cached = next(iter(self._senders.items()))
            if cached.last_used >= used_before:
                break
            del self._senders[key]
            cached.socket.close(0)  # idle this long: whatever is still queued is stale
            num_evicted += 1
        return num_evicted

    def _sender(self, host: str, port: int, now: float) -> zmq.Socket:
        cached = self._senders.get((host, port))
        if cached is not None:
            cached.last_used = now
            self._senders.move_to_end((host, port))
            return cached.socket
        while len(self._senders) >= self.max_sockets:
            _, oldest = self._senders.popitem(last=False)
            oldest.socket.close(_LINGER_MS)
        socket = self._context.socket(zmq.DEALER)
        try:
            socket.setsockopt(zmq.LINGER, _LINGER_MS)
            socket.setsockopt(zmq.SNDHWM, SEND_QUEUE)
            socket.setsockopt(zmq.RCVHWM, NOTICE_QUEUE)
            socket.setsockopt(zmq.MAXMSGSIZE, MAX_NOTICE_FRAME_BYTES)
            if ":" in host:
                socket.setsockopt(zmq.IPV6, 1)
            socket.connect(tcp_endpoint(host, port))
        except zmq.ZMQError as e:
            socket.close(0)
            raise TransferError(f"cannot connect to {host}:{port}: {e}") from None
        self._senders[(host, port)] = _CachedSocket(socket, now)
        return socket


def _peer_address(frame: zmq.Frame) -> str:
    try:
        return frame.get("Peer-Address")
    except (zmq.ZMQError, AttributeError, TypeError):
        return "unknown peer"
