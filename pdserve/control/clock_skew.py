"""The sending side of a clock-skew refusal: a server that refuses an authentic frame for its timestamp
answers with a ClockSkew notice (endpoint.Server), and the socket that sent the frame reads it here
after its next send. The notice is refused as skewed by our codec as well, which measures the
offset itself; it is logged on this side, with the offset, at most once per `interval_s` per peer,
so that an instance whose clock is off says why it is not registered or served."""

from __future__ import annotations

import logging
import time

import zmq

from pdserve.control.codec import ClockSkewError, Codec
from pdserve.control.messages import ClockSkew
from pdserve.errors import ProtocolError

logger = logging.getLogger(__name__)

WARN_INTERVAL_S = 60.0
_MAX_READS = 16  # notices read per call: a socket's queue holds at most NOTICE_QUEUE


class SkewNotices:
    """Reads the ClockSkew notices queued on sockets that otherwise only send. Not thread-safe: each
    owner calls `read` under its own lock or from its own thread."""

    def __init__(self, codec: Codec, interval_s: float = WARN_INTERVAL_S):
        self.codec = codec
        self.interval_s = interval_s
        self.offsets: dict[str, float] = {}  # peer -> the last measured offset (its clock minus ours)
        self._warned_at: dict[str, float] = {}

    def read(self, socket: zmq.Socket, peer: str, refused: str = "its messages") -> float | None:
        """Read what `socket` (connected to `peer`) has received; log a skew it reports (`refused`
        names what the peer refuses). Returns the offset measured, if any."""
        measured = None
        for _ in range(_MAX_READS):
            try:
                frame = socket.recv(zmq.NOBLOCK)
            except zmq.ZMQError:
                break  # nothing queued (zmq.Again), or the socket is closing
            offset = self._offset(frame)
            if offset is not None:
                measured = offset
        if measured is not None:
            self._warn(peer, measured, refused)
        return measured

    def _offset(self, frame: bytes) -> float | None:
        try:
            envelope = self.codec.decode(frame)
        except ClockSkewError as skew:
            return skew.offset_s
        except ProtocolError as error:
            logger.debug("ignored a frame on a send-only socket: %s", error)
            return None
        if isinstance(envelope.message, ClockSkew):  # inside our window, outside the peer's (a narrower one)
            return -envelope.message.offset_s
        return None

    def _warn(self, peer: str, offset_s: float, refused: str) -> None:
        self.offsets[peer] = offset_s
        now = time.monotonic()
        if now - self._warned_at.get(peer, float("-inf")) < self.interval_s:
            return
        self._warned_at[peer] = now
        direction = "ahead of" if offset_s > 0 else "behind"
        logger.warning(
            "pdserve: %s refuses %s: its clock is %.1f s %s this host's, beyond the control plane's skew window "
            "(%g s here); synchronise the clocks (NTP)", peer, refused, abs(offset_s), direction, self.codec.max_skew_s)
