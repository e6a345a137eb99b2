"""The front's lifecycle: listen, serve, drain with a deadline, cut off the stragglers.

    server = FrontServer(config); await server.start()     # NEW -> SERVING
    ...
    num_cut_off = await server.drain()                      # SERVING -> DRAINING -> STOPPED

While draining the listener stays open and every new request is answered 503 in OpenAI's shape
("pdserve is shutting down ..."), so a client learns why instead of seeing a refused connection;
requests already in flight run to their end, until `drain_timeout`. Then every connection still
open is closed and the listener with them.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging

from pdserve.errors import LaunchError
from pdserve.launch.front import exchange
from pdserve.launch.front.config import FrontConfig
from pdserve.launch.front.exchange import Client
from pdserve.launch.front.http1 import MAX_HEAD_BYTES, HttpProtocolError, read_request_head
from pdserve.launch.front.openai_error import OpenAIError

logger = logging.getLogger(__name__)

HEAD_TIMEOUT = 60.0  # a connection that sends no request head in this long is closed
DRAINING_MESSAGE = "pdserve is shutting down: new requests are refused while the ones in flight finish"


class State(enum.Enum):
    NEW = "new"
    SERVING = "serving"
    DRAINING = "draining"
    STOPPED = "stopped"


class FrontServer:
    """An asyncio server with one task per connection; a connection carries one request."""

    def __init__(self, config: FrontConfig) -> None:
        self.config = config
        self.state = State.NEW
        self._server: asyncio.Server | None = None
        self._connections: set[asyncio.Task] = set()  # every open connection
        self._in_flight: set[asyncio.Task] = set()  # those whose request was accepted
        self._idle = asyncio.Event()  # set while nothing is in flight
        self._idle.set()

    @property
    def num_in_flight(self) -> int:
        return len(self._in_flight)

    async def start(self) -> None:
        self._expect(State.NEW)
        self._server = await asyncio.start_server(self._serve, self.config.host, self.config.port,
                                                  limit=MAX_HEAD_BYTES, reuse_address=True)
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
        assert self._server is not None
        self._server.close()
        for task in list(self._connections):
            task.cancel()
        await asyncio.gather(*self._connections, return_exceptions=True)
        await self._server.wait_closed()
        self.state = State.STOPPED
        return num_cut_off

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._connections.add(task)
        client = Client(reader, writer)
        try:
            try:
                async with asyncio.timeout(HEAD_TIMEOUT):
                    request = await read_request_head(reader)
            except HttpProtocolError as exc:
                await client.send(OpenAIError(400, f"malformed request: {exc}").response())
                return
            if self.state is not State.SERVING:
                await client.send(OpenAIError(503, DRAINING_MESSAGE).response())
                return
            self._in_flight.add(task)
            self._idle.clear()
            await exchange.handle(request, client, self.config.upstream, self.config.model_sources,
                                  self.config.idle_timeout)
        except (ConnectionError, asyncio.IncompleteReadError, HttpProtocolError, TimeoutError) as exc:
            logger.debug("connection ended early: %r", exc)  # a side went away mid-request
        except Exception:  # the connection's boundary: one bad exchange must not stop the server
            logger.exception("front: request failed")
        finally:
            self._in_flight.discard(task)
            if not self._in_flight:
                self._idle.set()
            self._connections.discard(task)
            writer.close()

    def _expect(self, state: State) -> None:
        if self.state is not state:
            raise LaunchError(f"front is {self.state.value}, expected {state.value}")
