"""The client's side of one relayed success (exchange.py): its head sent with its first piece, each
piece written within the idle timeout; a failure after the head is RelayBrokeOff."""

from __future__ import annotations

import asyncio

import aiohttp
from aiohttp import web

from pdserve.front.headers import response_headers

# A piece this small written to an empty send buffer cannot wait for the client to read (asyncio
# pauses writing at 64 KiB buffered): it is written without a timer, a third of the CPU a relayed
# piece costs
UNBLOCKED_WRITE_BYTES = 16 << 10


class RelayBrokeOff(Exception):
    """A response failed after its head was relayed (the upstream broke off or went silent, or the
    client stopped reading): only closing the connection tells the client."""


class Relay:
    """The client's side of one relayed success: its head is sent with the first piece written."""

    def __init__(self, request: web.BaseRequest, answer: aiohttp.ClientResponse, idle_timeout: float,
                 rewritten: bool) -> None:
        self._request = request
        self._idle_timeout = idle_timeout
        headers = response_headers(answer.headers)
        if rewritten:  # a followed stream's events are rewritten: its length is not the upstream's
            headers.popall("Content-Length", None)
        self.response = web.StreamResponse(status=answer.status, reason=answer.reason, headers=headers)

    @property
    def started(self) -> bool:
        return self.response.prepared

    async def write(self, piece: bytes) -> None:
        """`piece` to the client; RelayBrokeOff where the client does not take it within the idle timeout."""
        if not piece:
            return
        try:
            if not self.started:
                await self.response.prepare(self._request)
            client = self._request.transport
            if client is not None and client.get_write_buffer_size() == 0 and len(piece) <= UNBLOCKED_WRITE_BYTES:
                await self.response.write(piece)  # cannot wait on the client: nothing to time
            else:
                async with asyncio.timeout(self._idle_timeout):
                    await self.response.write(piece)
        except (aiohttp.ClientError, ConnectionError, TimeoutError) as exc:
            raise RelayBrokeOff(f"{self._request.method} {self._request.path}: the client: {exc!r}") from exc

    async def finish(self) -> web.StreamResponse:
        if not self.started:
            await self.response.prepare(self._request)
        await self.response.write_eof()
        return self.response
