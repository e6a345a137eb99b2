"""Reading a request body within the front's limits, so that no client can take its memory or its slots.

    body = await intake.read(request)      # RequestRefused: 413, 408, 503, 417, 400
    ...                                    # the request is served
    intake.release(len(body))              # when its handler returns

Three limits hold while a body arrives: one body is at most `max_body_bytes` (413); all the bodies
the front holds, from their first byte until their request ends, are at most
`max_body_bytes_in_flight` together (one more is answered 503 at once, before it is read); a body
must arrive within `body_timeout`, and once the connection slots near their limit (ConnectionSlots'
pressure) within `busy_body_timeout` of its start, those already arriving included: clients that
send their bodies slowly cannot keep a slot from a waiting client for long.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from aiohttp import web
from aiohttp.web_protocol import RequestPayloadError

from pdserve.front.config import Limits
from pdserve.front.openai_error import OpenAIError


class RequestRefused(Exception):
    """The client's request breaks a limit; `error` answers it and the connection closes."""

    def __init__(self, error: OpenAIError) -> None:
        super().__init__(error.message)
        self.error = error


class Intake:
    """Bodies being read and held: their bytes against the in-flight budget, their deadlines.
    `pressured`: whether the connection slots are near their limit (asked as each body starts)."""

    def __init__(self, limits: Limits, pressured: Callable[[], bool]) -> None:
        self._limits = limits
        self._pressured = pressured
        self.num_bytes_held = 0
        self._arriving: dict[asyncio.Timeout, float] = {}  # the deadlines not yet tightened, by body start

    @property
    def _busy_timeout(self) -> float:
        return min(self._limits.busy_body_timeout, self._limits.body_timeout)

    def tighten(self) -> None:
        """The slots near their limit: every body still arriving must be whole `busy_body_timeout` after
        its start (each is tightened once: bodies that start under pressure start tight)."""
        for deadline, started in self._arriving.items():
            when = deadline.when()
            busy = started + self._busy_timeout
            if when is None or busy < when:
                deadline.reschedule(busy)
        self._arriving.clear()

    def release(self, num_bytes: int) -> None:
        self.num_bytes_held -= num_bytes

    async def read(self, request: web.BaseRequest) -> bytearray:
        """The body, read whole within the limits; its bytes stay held until release()."""
        limits = self._limits
        too_large = RequestRefused(OpenAIError(413, f"the request body is over the limit of {limits.max_body_bytes} bytes"))
        declared = request.content_length
        if declared is not None and declared > limits.max_body_bytes:
            raise too_large
        if declared is not None and not self._hold(declared):
            raise self._busy()
        if (expect := request.headers.get("Expect")) is not None:
            if expect.lower() != "100-continue":
                self.release(declared or 0)
                raise RequestRefused(OpenAIError(417, f"Expect: {expect[:40]!r} is not supported"))
            await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        body = bytearray()
        held = declared or 0
        loop = asyncio.get_running_loop()
        started = loop.time()
        timeout = self._busy_timeout if self._pressured() else limits.body_timeout
        try:
            async with asyncio.timeout(timeout) as deadline:
                if timeout > self._busy_timeout:
                    self._arriving[deadline] = started
                try:
                    while chunk := await request.content.readany():
                        body += chunk
                        if len(body) > limits.max_body_bytes:
                            raise too_large
                        if len(body) > held:
                            if not self._hold(len(body) - held):
                                raise self._busy()
                            held = len(body)
                finally:
                    self._arriving.pop(deadline, None)
        except TimeoutError:
            self.release(held)
            allowed = round((deadline.when() or loop.time()) - started, 1)
            raise RequestRefused(OpenAIError(408, f"the request body did not arrive within {allowed:g} s")) from None
        except RequestPayloadError as exc:
            self.release(held)
            raise RequestRefused(OpenAIError(400, f"malformed request body: {exc}")) from None
        except BaseException:
            self.release(held)
            raise
        self.release(held - len(body))
        return body  # a bytearray: not copied

    def _hold(self, num_bytes: int) -> bool:
        if self.num_bytes_held + num_bytes > self._limits.max_body_bytes_in_flight:
            return False
        self.num_bytes_held += num_bytes
        return True

    def _busy(self) -> RequestRefused:
        return RequestRefused(OpenAIError(503, f"the server holds its limit of {self._limits.max_body_bytes_in_flight} "
                                               "bytes of request bodies: retry later"))


