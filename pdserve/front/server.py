"""The front's lifecycle: listen, serve, drain with a deadline, cut off the stragglers.

    server = FrontServer(config); await server.start()     # NEW -> SERVING
    ...
    num_cut_off = await server.drain()                      # SERVING -> DRAINING -> STOPPED

While draining the listener stays open and every new request is answered 503 in OpenAI's shape
("pdserve is shutting down ..."), so a client learns why instead of seeing a refused connection;
requests already in flight run to their end, until `drain_timeout`. Then those still in flight
are cancelled, every connection is closed, and the listener and the upstream pool with them.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import os
import socket

from aiohttp import web

from pdserve.errors import LaunchError
from pdserve.front.config import FrontConfig
from pdserve.front.connections import Connections, ConnectionSlots
from pdserve.front.exchange import Exchange
from pdserve.front.openai_error import OpenAIError

DRAINING_MESSAGE = "pdserve is shutting down: new requests are refused while the ones in flight finish"
LINGER_S = 2.0  # after an answer to a request not read whole (413, 408), how long its rest is read and dropped
CLOSE_TIMEOUT = 1.0  # at the end of the drain, how long a connection may take to close
# asyncio accepts up to its `backlog` waiting connections in one turn of the loop (~0.15 ms each): a
# burst of 1,024 would stall every stream ~150 ms, so it takes them 16 at a time
ACCEPT_BATCH = 16


class State(enum.Enum):
    NEW = "new"
    SERVING = "serving"
    DRAINING = "draining"
    STOPPED = "stopped"


class FrontServer:
    """aiohttp's HTTP/1.1 server on the client side, an aiohttp client pool on the upstream side."""

    def __init__(self, config: FrontConfig) -> None:
        self.config = config
        self.state = State.NEW
        self._slots = ConnectionSlots(config.limits.max_connections, config.limits.connection_wait)
        self._exchange = Exchange(config, lambda: self._slots.pressured)
        self._slots.on_pressure = self._exchange.tighten
        self._connections: Connections | None = None  # made on the loop, by start()
        self._listener: asyncio.Server | None = None
        self._in_flight: set[asyncio.Task] = set()  # the handlers of requests accepted, until they return
        self._idle = asyncio.Event()  # set while nothing is in flight
        self._idle.set()

    @property
    def num_in_flight(self) -> int:
        return len(self._in_flight)

    @property
    def num_connections(self) -> int:
        """Client connections being served (those waiting for a slot not counted)."""
        return self._slots.num_held

    @property
    def num_body_bytes_held(self) -> int:
        """Bytes of request bodies held (against Limits.max_body_bytes_in_flight)."""
        return self._exchange.num_body_bytes_held

    @property
    def num_waiting(self) -> int:
        """Client connections waiting for a slot."""
        return self._slots.num_waiting

    async def start(self) -> None:
        self._expect(State.NEW)
        limits = self.config.limits
        self._connections = Connections(
            self._handle, self._slots, keepalive_timeout=limits.head_timeout, max_line_size=limits.max_header_bytes,
            max_field_size=limits.max_header_bytes, max_headers=limits.max_headers, auto_decompress=False,
            access_log=None, lingering_time=LINGER_S)
        await self._exchange.open()
        try:
            self._listener = await asyncio.get_running_loop().create_server(
                self._connections, self.config.host, self.config.port, reuse_address=True, backlog=ACCEPT_BATCH)
        except BaseException:
            await self._exchange.close()
            raise
        for listening in self._listener.sockets:  # the kernel queues up to max_connections
            with socket.socket(fileno=os.dup(listening.fileno())) as sock:  # closing the dup leaves it listening
                sock.listen(limits.max_connections)
        self.state = State.SERVING

    async def drain(self) -> int:
        """Refuse new requests, let those in flight finish until the drain timeout, close the rest.
        Returns how many requests were cut off."""
        self._expect(State.SERVING)
        self.state = State.DRAINING
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self.config.drain_timeout):
                await self._idle.wait()
        num_cut_off = len(self._in_flight)
        stragglers = list(self._in_flight)
        for task in stragglers:
            task.cancel()
        await asyncio.gather(*stragglers, return_exceptions=True)
        assert self._listener is not None and self._connections is not None
        self._listener.close()
        self._connections.pre_shutdown()
        await self._connections.shutdown(CLOSE_TIMEOUT)
        await self._listener.wait_closed()
        await self._exchange.close()
        self.state = State.STOPPED
        return num_cut_off

    async def _handle(self, request: web.BaseRequest) -> web.StreamResponse:
        if self.state is not State.SERVING:
            return OpenAIError(503, DRAINING_MESSAGE).response(close=True)
        task = asyncio.current_task()
        assert task is not None
        self._in_flight.add(task)
        self._idle.clear()
        try:
            return await self._exchange.handle(request)
        finally:
            self._in_flight.discard(task)
            if not self._in_flight:
                self._idle.set()

    def _expect(self, state: State) -> None:
        if self.state is not state:
            raise LaunchError(f"front is {self.state.value}, expected {state.value}")
