"""The front's client connections: aiohttp's HTTP/1.1 server, with a limit on how many it serves at once
and every error it answers itself (a malformed or oversized head) in OpenAI's shape.

    slots = ConnectionSlots(capacity=1024, wait=1.0)
    listener = await loop.create_server(Connections(handler, slots, head_timeout=5.0, ...), host, port)

A connection over the capacity is held, unread, until a slot frees or `wait` runs out; then it is
answered 503 and closed. At most `capacity` connections wait; one more is answered 503 at once.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Callable

from aiohttp import web

from pdserve.front.openai_error import OpenAIError
from pdserve.front.relay import RelayBrokeOff

logger = logging.getLogger(__name__)


class ConnectionSlots:
    """`capacity` slots; a slot freed goes to the connection that has waited longest. Under pressure
    (7/8 of the slots held, or a connection waiting) `on_pressure` is called as each connection comes."""

    def __init__(self, capacity: int, wait: float, on_pressure: Callable[[], None] = lambda: None) -> None:
        self.capacity = capacity
        self.wait = wait
        self.num_held = 0
        self.on_pressure = on_pressure
        self._pressure_at = capacity - capacity // 8
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()

    @property
    def pressured(self) -> bool:
        return self.num_held >= self._pressure_at or bool(self._waiters)

    @property
    def num_waiting(self) -> int:
        return sum(not w.done() for w in self._waiters)

    def arrived(self) -> None:
        """A connection came, before it asks for a slot: under pressure, on_pressure is told."""
        if self.num_held + 1 >= self._pressure_at or self._waiters:
            self.on_pressure()

    def try_acquire(self) -> bool:
        if self.num_held < self.capacity:
            self.num_held += 1
            return True
        return False

    async def acquire(self) -> bool:
        """Wait up to `wait` seconds for a slot; False if none came."""
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            async with asyncio.timeout(self.wait):
                await waiter
            return True
        except TimeoutError:
            return self._handed(waiter)  # a slot may have come just as the wait ran out
        except asyncio.CancelledError:
            if self._handed(waiter):
                self.release()
            raise
        finally:
            if waiter in self._waiters:
                self._waiters.remove(waiter)

    @staticmethod
    def _handed(waiter: asyncio.Future[None]) -> bool:
        return waiter.done() and not waiter.cancelled()

    def release(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)  # the slot passes to it: num_held stays
                return
        self.num_held -= 1


class ReadPacer:
    """New connections start reading at most `per_turn` to a turn of the event loop; the rest wait,
    paused, for later turns. A burst of a thousand connections (each ~0.2 ms to take in) is then
    spread over many turns, between which streams already flowing are relayed."""

    def __init__(self, per_turn: int = 16) -> None:
        self.per_turn = per_turn
        self._num_started = 0  # in this turn
        self._paused: collections.deque[asyncio.Transport] = collections.deque()
        self._turn_scheduled = False

    def start(self, transport: asyncio.Transport) -> None:
        """`transport` (just connected) reads now, or once its turn comes."""
        if self._num_started < self.per_turn and not self._paused:
            self._num_started += 1
        else:
            transport.pause_reading()
            self._paused.append(transport)
        self._schedule()

    def _schedule(self) -> None:
        if not self._turn_scheduled:
            self._turn_scheduled = True
            asyncio.get_running_loop().call_soon(self._next_turn)

    def _next_turn(self) -> None:
        self._turn_scheduled = False
        self._num_started = 0
        while self._paused and self._num_started < self.per_turn:
            transport = self._paused.popleft()
            if not transport.is_closing():
                transport.resume_reading()
                self._num_started += 1
        if self._paused or self._num_started:
            self._schedule()


def _busy(capacity: int) -> OpenAIError:
    return OpenAIError(503, f"the server is at its limit of {capacity} connections: retry later")


class FrontConnection(web.RequestHandler):
    """One client connection: served once it holds a slot."""

    def __init__(self, manager: Connections, slots: ConnectionSlots, pacer: ReadPacer, **kwargs) -> None:
        super().__init__(manager, **kwargs)
        self._slots = slots
        self._pacer = pacer
        self._holds_slot = False
        self._admission: asyncio.Task | None = None

    # aiohttp reads its `_lingering_time` once it answered a request whose body it did not read whole
    # (413, 408): it then reads and drops the rest for that long. A slow sender would keep its slot
    # through it, so near the connection limit the connection closes at once instead.
    @property
    def _lingering_time(self) -> float:
        return 0.0 if self._slots.pressured else self._linger

    @_lingering_time.setter
    def _lingering_time(self, value: float) -> None:
        self._linger = value

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self._slots.arrived()
        if self._slots.try_acquire():
            self._holds_slot = True
            self._pacer.start(transport)
        elif self._slots.num_waiting >= self._slots.capacity:
            self._refuse(transport)
        else:
            transport.pause_reading()
            self._admission = asyncio.ensure_future(self._admit(transport))

    def connection_lost(self, exc: BaseException | None) -> None:
        if self._admission is not None:
            self._admission.cancel()
        if self._holds_slot:
            self._holds_slot = False
            self._slots.release()
        super().connection_lost(exc)

    async def _admit(self, transport: asyncio.BaseTransport) -> None:
        if not await self._slots.acquire():
            self._refuse(transport)
            return
        self._holds_slot = True
        if transport.is_closing():
            self._holds_slot = False
            self._slots.release()
        else:
            transport.resume_reading()

    def _refuse(self, transport: asyncio.BaseTransport) -> None:
        transport.write(_busy(self._slots.capacity).raw())
        self.force_close()

    def handle_error(self, request: web.BaseRequest, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        """The answer to a request aiohttp could not parse, or whose handler raised."""
        if isinstance(exc, RelayBrokeOff) or request.writer.output_size > 0:
            logger.warning("front: response broken off: %s", exc)  # only closing the connection tells the client
            raise ConnectionError(f"response broken off: {exc}")
        if status >= 500:
            logger.error("front: request failed", exc_info=exc)
            return OpenAIError(status, "the front failed to handle the request (see its log)").response(close=True)
        detail = (message or str(exc or "")).strip().split("\n", 1)[0].rstrip(":")
        return OpenAIError(status, f"malformed request: {detail}").response(close=True)


class Connections(web.Server):
    """aiohttp's low-level server, making a FrontConnection per connection."""

    def __init__(self, handler, slots: ConnectionSlots, **connection_options) -> None:
        super().__init__(handler, handler_cancellation=True)
        self._slots = slots
        self._pacer = ReadPacer()
        self._connection_options = connection_options

    def __call__(self) -> FrontConnection:
        return FrontConnection(self, self._slots, self._pacer, loop=asyncio.get_running_loop(),
                               **self._connection_options)
