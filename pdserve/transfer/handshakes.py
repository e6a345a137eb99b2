"""The threads that run handshakes: one per address at a time, a bounded number at once, none queued.

Peer addresses come from requests that anyone who reaches an instance's HTTP port can send, and a
handshake with an address that never answers lasts the whole `handshake_timeout`. So no handshake
ever waits for another: each starts on its own thread when it is asked for. At most `max_strangers`
run at once for addresses that never completed a handshake with us; past that, a stranger is
refused at once, naming the address, and its caller fails what needed it (and may ask again later).
Addresses that did complete one (`known`) are never refused for lack of room: a legitimate peer
that restarts is handshaken again however many strangers are pending.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from pdserve.control.address import PeerAddress

logger = logging.getLogger("pdserve.connector")


class HandshakeThreads:
    """Used from any thread. `handshake(address)` runs on a thread of its own and must not raise;
    its result goes to `deliver` once the address counts as idle again, so a caller that reacts
    to the result by asking for another handshake with that address always gets one."""

    def __init__(self, handshake: Callable[[PeerAddress], object], deliver: Callable[[object], None],
                 max_strangers: int):
        self._handshake = handshake
        self._deliver = deliver
        self._max_strangers = max_strangers
        self._lock = threading.Lock()
        self._running: dict[PeerAddress, bool] = {}  # address -> known, until its result is ready
        self._threads: list[threading.Thread] = []  # started and maybe not yet ended, for close()
        self._closed = False

    def start(self, address: PeerAddress, known: bool) -> str:
        """Handshake `address` unless a handshake with it runs already. Returns "" when one runs
        now, else why none will (the address named)."""
        where = f"{address.host}:{address.handshake_port}"
        with self._lock:
            if self._closed:
                return f"not handshaking {where}: the connector is shutting down"
            if address in self._running:
                return ""
            if not known and self._num_strangers() >= self._max_strangers:
                return (f"not handshaking {where}: {self._max_strangers} handshakes with peers never met are "
                        "already in flight (unreachable peer addresses in requests?)")
            thread = threading.Thread(target=self._run, args=(address,), name=f"pdserve-handshake-{where}", daemon=True)
            self._running[address] = known
            self._threads = [t for t in self._threads if t.is_alive()] + [thread]
            thread.start()
        return ""

    @property
    def num_running(self) -> int:
        with self._lock:
            return len(self._running)

    def close(self, deadline_s: float) -> int:
        """Refuse new handshakes and join the running ones for up to `deadline_s`; returns how many
        still run (each ends by its own handshake timeout, or when the control client closes)."""
        with self._lock:
            self._closed = True
            threads = list(self._threads)
        until = time.monotonic() + deadline_s
        for thread in threads:
            thread.join(max(0.0, until - time.monotonic()))
        left = sum(thread.is_alive() for thread in threads)
        if left:
            logger.warning("pdserve: %d handshakes still running at shutdown; they end by their own timeout", left)
        return left

    def _num_strangers(self) -> int:
        return sum(not known for known in self._running.values())

    def _run(self, address: PeerAddress) -> None:
        try:
            result = self._handshake(address)
        finally:
            with self._lock:
                del self._running[address]  # only this thread handshakes `address` until now
        self._deliver(result)
