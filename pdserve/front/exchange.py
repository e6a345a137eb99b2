"""One request through the front: answered here, or forwarded over a kept-alive upstream connection.

    GET /v1/models   asked of the instances in turn (vllm-router's PD discovery mode has no
                     instance of its own to ask, and answers 503 "No prefill servers available")
    GET /metrics     the front's own series (metrics.py), where it has instances to fall back on
    anything else    its body read whole (within the body limits, chunked decoded), sent with a
                     Content-Length to the upstream routes.py picks; a success is relayed piece
                     by piece as it arrives (its head with its first piece), an error read whole
                     and answered in OpenAI's shape (openai_error.from_upstream)

Where the front has instances to fall back on (a PD deployment), a request that failed before
anything reached the client, in a way that left nothing running upstream (a refused, reset or
closed connection; 500, 502 or 503; a success whose body broke before its first piece), is resent
once, whole, to a live instance as a plain request. A streamed generation that broke off after
tokens reached the client is continued on a live instance (continuation.py). A client error, a
silent upstream (it may still be computing) and any other response broken after its head was
relayed are never resent.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable

import aiohttp
import yarl
from aiohttp import web

from pdserve.front.body import BodyRefused, RequestBody
from pdserve.front.config import FrontConfig, Upstream
from pdserve.front.continuation import COMPLETIONS, Follow
from pdserve.front.headers import forbidden_header, request_headers
from pdserve.front.instances import InstancePool
from pdserve.front.intake import Intake, RequestRefused
from pdserve.front.metrics import CONTENT_TYPE, CONTINUED, FAILED_NO_INSTANCE, RETRIED, FrontMetrics
from pdserve.front.openai_error import ErrorBody, OpenAIError, from_upstream
from pdserve.front.relay import Relay, RelayBrokeOff
from pdserve.front.routes import Routes
from pdserve.front.upstream import (
    MAX_ERROR_BODY_BYTES,
    RESENT_STATUSES,
    TooLarge,
    Unanswered,
    client_error,
    error_message,
    read_bounded,
    resend_reason,
    upload,
)

logger = logging.getLogger(__name__)

CONNECT_TIMEOUT = 10.0
MODELS_PATH = "/v1/models"
METRICS_PATH = "/metrics"
# vLLM's server (uvicorn) closes a connection idle for 5 s: the pool lets go of it first, so it
# never sends a request on a connection the instance is closing
UPSTREAM_KEEPALIVE_S = 4.0


class Exchange:
    """The front's request handler, with its pool of connections to the upstreams (open() to close())."""

    def __init__(self, config: FrontConfig, pressured: Callable[[], bool] = lambda: False) -> None:
        self.metrics = FrontMetrics()
        self._intake = Intake(config.limits, pressured)
        self.instances = InstancePool(config.fallback_sources, self.metrics)
        self._routes = Routes(config.upstream, config.direct_sources, self.instances, self.metrics)
        self._model_sources = config.model_sources
        self._max_model_lens: dict[Upstream, int] = {}
        known = {config.upstream, *config.model_sources, *config.direct_sources, *config.fallback_sources}
        # longest first: "http://127.0.0.1:18002" before "127.0.0.1:18002"
        self._addresses = sorted(((address.encode(), u.name) for u in known
                                  for address in (u.url, f"{u.host}:{u.port}")), key=lambda a: -len(a[0]))
        self._limits = config.limits
        self._session: aiohttp.ClientSession | None = None

    async def open(self) -> None:
        connector = aiohttp.TCPConnector(limit=self._limits.max_connections, limit_per_host=0,
                                         keepalive_timeout=UPSTREAM_KEEPALIVE_S)
        timeout = aiohttp.ClientTimeout(total=None, connect=CONNECT_TIMEOUT, sock_read=self._limits.idle_timeout)
        self._session = aiohttp.ClientSession(connector=connector, timeout=timeout, auto_decompress=False,
                                              skip_auto_headers=("Accept", "Accept-Encoding", "User-Agent",
                                                                 "Content-Type"))
        self.instances.start(self._session)

    async def close(self) -> None:
        await self.instances.stop()
        if self._session is not None:
            await self._session.close()

    @property
    def num_body_bytes_held(self) -> int:
        return self._intake.num_bytes_held

    def tighten(self) -> None:
        """The connection slots near their limit: bodies still arriving get the shorter deadline."""
        self._intake.tighten()

    async def handle(self, request: web.BaseRequest) -> web.StreamResponse:
        """Answer `request` (its head read; its body not yet)."""
        try:
            if not request.raw_path.startswith("/"):  # absolute-form: the front is not a forward proxy
                raise RequestRefused(OpenAIError(400, f"the request target must be a path, got {request.raw_path[:80]!r}"))
            if (name := forbidden_header(request.headers)) is not None:
                raise RequestRefused(OpenAIError(400, f"header {name} holds a CR, LF or NUL character"))
            if request.method == "GET" and request.path == MODELS_PATH:
                return await self._models(request)
            if request.method == "GET" and request.path == METRICS_PATH and self.instances.sources:
                return web.Response(body=self.metrics.render().encode(), headers={"Content-Type": CONTENT_TYPE})
            raw = await self._intake.read(request)
        except RequestRefused as refused:
            return refused.error.response(close=True)
        num_held = len(raw)
        try:
            try:
                body = RequestBody.parse(raw, request.headers.get("Content-Type"))
            except BodyRefused as refused:
                return refused.error.response()
            del raw  # forwarded as body.raw (the same bytes where nothing was taken out)
            return await self._serve(request, body)
        finally:
            self._intake.release(num_held)

    async def _serve(self, request: web.BaseRequest, body: RequestBody) -> web.StreamResponse:
        """Send the request where routes.py says; where that failed unanswered, once more to another
        live instance (after a probe round: the failure may be an instance's death)."""
        upstream = self._routes.pick(request.method, request.path, body)
        if upstream is None:
            return self._no_instance(())
        try:
            return await self._forward(request, body, upstream, self._follow(request, body))
        except Unanswered as failure:
            if not self.instances.sources:
                return failure.answer.response()
            first = failure
        await self.instances.refresh()
        instance = self.instances.pick(exclude=upstream)
        if instance is None:
            return self._no_instance((first,))
        self.metrics.count(RETRIED, reason=first.reason)
        logger.info("front: %s %s resent to the %s: %s", request.method, request.path, instance.name, first.what)
        try:
            return await self._forward(request, body, instance, self._follow(request, body))
        except Unanswered as second:
            return self._no_instance((first, second))

    def _follow(self, request: web.BaseRequest, body: RequestBody) -> Follow | None:
        """A streamed generation to follow, so that it can be continued (only with instances to continue on)."""
        return Follow.start(request.method, request.path, body) if self.instances.sources else None

    def _no_instance(self, failures: tuple[Unanswered, ...]) -> web.Response:
        self.metrics.count(FAILED_NO_INSTANCE)
        tried = {failure.upstream for failure in failures}
        causes = [failure.what for failure in failures]
        causes += [f"the {each.name} is down" for each in self.instances.down() if each not in tried]
        return OpenAIError(503, f"no live instance to serve the request: {'; '.join(causes)}").response()

    async def _forward(self, request: web.BaseRequest, body: RequestBody, upstream: Upstream,
                       follow: Follow | None = None) -> web.StreamResponse:
        """`upstream`'s answer to the request, relayed (through `follow`, which also sets the body
        sent); Unanswered where it failed leaving nothing to relay and nothing running."""
        assert self._session is not None
        url = yarl.URL(upstream.url + request.raw_path, encoded=True)
        sent = follow.upstream_body if follow is not None else body
        headers = request_headers(request.headers)
        try:
            answer = await self._session.request(request.method, url, headers=headers, data=upload(sent, headers),
                                                 allow_redirects=False)
        except (aiohttp.ClientError, TimeoutError) as exc:
            failure = client_error(upstream, exc, self._limits.idle_timeout)
            if isinstance(exc, aiohttp.ClientOSError):  # refused or reset
                self.instances.mark_down(upstream, str(exc))
            if (reason := resend_reason(exc)) is None:
                return failure.response()
            raise Unanswered(upstream, reason, failure.message, failure) from exc
        async with answer:
            if answer.status >= 400:
                try:
                    error_body = await read_bounded(answer.content, MAX_ERROR_BODY_BYTES)
                except (aiohttp.ClientError, TimeoutError, TooLarge) as exc:
                    return client_error(upstream, exc, self._limits.idle_timeout).response()
                error = self._unaddressed(from_upstream(answer.status, error_body, f"{request.method} {request.path}"))
                if answer.status in RESENT_STATUSES:
                    what = f"the {upstream.name} answered {answer.status}: {error_message(error)}"
                    raise Unanswered(upstream, "upstream_5xx", what, error)
                return error.response()
            return await self._relay(request, answer, upstream, follow)

    async def _relay(self, request: web.BaseRequest, answer: aiohttp.ClientResponse, upstream: Upstream,
                     follow: Follow | None) -> web.StreamResponse:
        """A success, piece by piece as it arrives (through `follow`); its head goes with its first
        piece, so that a body that breaks before it is still Unanswered. A followed stream that
        broke off after tokens reached the client is continued (_continue)."""
        relay = Relay(request, answer, self._limits.idle_timeout, follow is not None)
        while True:
            try:
                piece = await answer.content.readany()
            except TimeoutError as exc:  # a silent upstream may still be computing: never resent
                if not relay.started:
                    return client_error(upstream, exc, self._limits.idle_timeout).response()
                raise RelayBrokeOff(f"{request.method} {request.path}: {exc!r}") from exc
            except aiohttp.ClientError as exc:
                if isinstance(exc, aiohttp.ClientOSError):  # reset
                    self.instances.mark_down(upstream, str(exc))
                if not relay.started:
                    logger.warning("front: the %s at %s broke off its answer: %r", upstream.name, upstream.url, exc)
                    what = f"the {upstream.name} broke off its answer before its body ({type(exc).__name__})"
                    raise Unanswered(upstream, "broke_before_first_byte", what, OpenAIError(502, what)) from exc
                if follow is None or not follow.unfinished():
                    raise RelayBrokeOff(f"{request.method} {request.path}: {exc!r}") from exc
                break
            if not piece:
                break
            await relay.write(follow.feed(piece) if follow is not None else piece)
        if follow is not None and relay.started and not follow.done:
            await self._continue(request, relay, follow, upstream)
        return await relay.finish()

    async def _continue(self, request: web.BaseRequest, relay: Relay, follow: Follow, broken: Upstream) -> None:
        """Continue each unfinished choice of `follow` on a live instance, its events spliced into
        `relay`; then end the stream (with an error event where a choice could not be finished
        exactly: Follow.refusal)."""
        assert self._session is not None
        failure, refused = "", False
        headers = {"Content-Type": "application/json"}
        if "Authorization" in request.headers:
            headers["Authorization"] = request.headers["Authorization"]
        for index in follow.unfinished():
            if (reason := follow.refusal(index)) is not None:
                logger.info("front: %s %s: %s", request.method, request.path, reason)
                failure, refused = reason, True
                break
            await self.instances.refresh()  # the break may be an instance's death
            instance = self.instances.pick(exclude=broken)
            if instance is None:
                failure = "the stream broke off and no live instance is left to continue it"
                break
            max_model_len = await self._max_model_len(instance) if follow.needs_max_model_len else None
            if follow.needs_max_model_len and max_model_len is None:
                failure = f"the stream broke off and the {instance.name} did not tell its max_model_len to continue it"
                break
            body = follow.continuation(index, max_model_len)
            if body is None:  # its budget was spent at the break
                await relay.write(follow.finish(index))
                continue
            self.metrics.count(CONTINUED)
            logger.info("front: %s %s broke off after %d tokens; continued on the %s", request.method, request.path,
                        len(follow.choices[index].ids), instance.name)
            try:
                async with self._session.post(f"{instance.url}{COMPLETIONS}", data=body, headers=headers) as answer:
                    if answer.status != 200:
                        error = await read_bounded(answer.content, MAX_ERROR_BODY_BYTES)
                        failure = f"the continuation on the {instance.name} answered {answer.status}: {error[:200]!r}"
                        break
                    while piece := await answer.content.readany():
                        await relay.write(follow.feed_continuation(index, piece))
            except (aiohttp.ClientError, TimeoutError, TooLarge) as exc:
                logger.warning("front: the continuation on the %s at %s failed: %r", instance.name, instance.url, exc)
                failure = f"the continuation on the {instance.name} failed ({type(exc).__name__})"
                break
        await relay.write(follow.closing(failure, refused))

    async def _max_model_len(self, instance: Upstream) -> int | None:
        """`instance`'s max_model_len, from its GET /v1/models (asked once); None if it did not answer it."""
        if instance not in self._max_model_lens:
            assert self._session is not None
            try:
                async with self._session.get(f"{instance.url}{MODELS_PATH}") as answer:
                    models = json.loads(await read_bounded(answer.content, MAX_ERROR_BODY_BYTES))
                self._max_model_lens[instance] = int(models["data"][0]["max_model_len"])
            except (aiohttp.ClientError, TimeoutError, TooLarge, ValueError, LookupError, TypeError) as exc:
                logger.warning("front: the %s at %s did not tell its max_model_len: %r", instance.name, instance.url, exc)
                return None
        return self._max_model_lens[instance]

    def _unaddressed(self, error: ErrorBody) -> ErrorBody:
        """`error` with every internal address the front knows replaced by its instance's name (logged first)."""
        body = error.body
        for address, name in self._addresses:
            if address in body:
                logger.warning("front: an error names the %s's address %s", name, address.decode())
                body = body.replace(address, name.encode())
        return ErrorBody(error.status, body)

    async def _models(self, request: web.BaseRequest) -> web.StreamResponse:
        assert self._session is not None
        failures = []
        for source in self._model_sources:
            try:
                async with self._session.get(f"{source.url}{MODELS_PATH}", headers=request_headers(request.headers)
                                             ) as answer:
                    body = await read_bounded(answer.content, MAX_ERROR_BODY_BYTES)
            except (aiohttp.ClientError, TimeoutError, TooLarge) as exc:
                failures.append(f"{source.name}: {client_error(source, exc, self._limits.idle_timeout).message}")
                continue
            if answer.status == 200:
                content_type = answer.headers.get("Content-Type", "application/json")
                return web.Response(body=body, headers={"Content-Type": content_type})
            failures.append(f"{source.name}: HTTP {answer.status}")
        return OpenAIError(503, f"no instance answered GET {MODELS_PATH} ({'; '.join(failures)})").response()
