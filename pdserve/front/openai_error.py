"""Errors in OpenAI's shape, as vLLM's own server sends them: the one place the front words them.

    {"error": {"message": "...", "type": "NotFoundError", "param": null, "code": 404}}

vllm-router answers errors as plain text, and wraps an instance's JSON error in its own words
("Prefill error 404 Not Found: {...}"). `from_upstream` turns any error response into this shape:
an instance's error object passes through unchanged (it names the cause best), the router's text
becomes the message, and the router's 422 for a body its schema rejects becomes the 400 vLLM
itself answers for an invalid body.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from http import HTTPStatus

from aiohttp import web

# vLLM's names where it has one (vllm/entrypoints/serve/exception_handling/error_response.py)
_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 403: "PermissionDeniedError",
          404: "NotFoundError", 422: "UnprocessableEntityError", 429: "RateLimitError",
          500: "InternalServerError", 501: "NotImplementedError", 503: "ServiceUnavailableError"}


def _reason(status: int) -> str:
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return "Error"


@dataclass(frozen=True)
class OpenAIError:
    """One error response: its status and the OpenAI error object's fields."""

    status: int
    message: str
    param: str | None = None

    @property
    def type(self) -> str:
        return _TYPES.get(self.status, _reason(self.status).replace(" ", ""))

    def body(self) -> bytes:
        error = {"message": self.message, "type": self.type, "param": self.param, "code": self.status}
        return json.dumps({"error": error}).encode()

    def response(self, close: bool = False) -> web.Response:
        """The response; `close`: the connection ends after it (the request was not read whole)."""
        return _json_response(self.status, self.body(), close)

    def raw(self) -> bytes:
        """The response as bytes for a bare transport, closing the connection."""
        body = self.body()
        head = (f"HTTP/1.1 {self.status} {_reason(self.status)}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n")
        return head.encode("latin-1") + body


@dataclass(frozen=True)
class ErrorBody:
    """An error response ready to send: status and JSON body (an upstream's, or ours)."""

    status: int
    body: bytes

    def response(self) -> web.Response:
        return _json_response(self.status, self.body, close=False)


def _json_response(status: int, body: bytes, close: bool) -> web.Response:
    response = web.Response(status=status, reason=_reason(status), body=body, content_type="application/json")
    if close:
        response.force_close()
    return response


def _openai_object(value: object) -> bool:
    return isinstance(value, dict) and isinstance(value.get("error"), dict) and "message" in value["error"]


def _embedded_json(text: str) -> object | None:
    """The JSON document a message ends with ("Prefill error 404 Not Found: {...}"), if any."""
    start = text.find("{")
    if start < 0:
        return None
    try:
        return json.loads(text[start:])
    except ValueError:
        return None


def from_upstream(status: int, body: bytes, what: str) -> ErrorBody:
    """The OpenAI-shaped form of an error response with `status` and `body`; `what` ("POST
    /v1/completions") words an empty body."""
    text = body.decode("utf-8", errors="replace").strip()
    try:
        whole = json.loads(text) if text else None
    except ValueError:
        whole = None
    if _openai_object(whole):
        return ErrorBody(status, body)
    embedded = whole if whole is not None else _embedded_json(text)
    if _openai_object(embedded):
        return ErrorBody(status, json.dumps(embedded).encode())
    if isinstance(embedded, dict) and isinstance(embedded.get("detail"), str):  # FastAPI's HTTPException
        text = embedded["detail"]
    if status == HTTPStatus.UNPROCESSABLE_ENTITY:
        status = HTTPStatus.BAD_REQUEST
    message = text or f"{what}: {_reason(status)}"
    return ErrorBody(status, OpenAIError(status, message).body())
