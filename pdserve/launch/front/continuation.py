"""Mid-stream continuation: a streamed generation that breaks off after some tokens goes on elsewhere.

A streamed completion or chat completion reaches the client as server-sent events. Where the
deployment has instances to fall back to, the front asks the upstream for each token's id
(`return_token_ids`, taken out again for a client that did not ask) and follows every choice:

    request ──▶ Follow.start(body)      streamed generation the front can continue? (else None)
    event   ──▶ Follow.feed(piece)      whole events out, as the client asked for them; ids kept
    break   ──▶ Follow.unfinished()     choices without a finish_reason when the stream broke off
            ──▶ Follow.continuation(i)  POST /v1/completions body: the prompt's ids + the ids streamed
            ──▶ Follow.feed_continuation(i, piece)  its events, rewritten as choice i of the original
            ──▶ Follow.closing()        the usage event (if asked) and [DONE]

A stream broke off when it ended (or failed) before `[DONE]`, or sent an error event after tokens,
with a choice unfinished. The continuation is a plain completion of the token ids streamed so far
with the tokens left of `max_tokens`: for a greedy request its tokens are those the uninterrupted
run would have produced; a sampled request gets a new draw conditioned on what the client already
has. Not continued (the client sees the break as today: the connection closes): chat requests
with tools or logprobs, requests with stop strings, beam search or `best_of`, several prompts in
one request, and `echo`. Pure: no I/O here (exchange.py sends and relays).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
DONE = b"data: [DONE]"
# sampling fields a continuation keeps as the client set them (the rest are the instance's defaults)
_CARRIED = ("model", "temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty",
            "repetition_penalty", "stop_token_ids", "ignore_eos", "skip_special_tokens",
            "spaces_between_special_tokens", "bad_words", "allowed_token_ids", "logit_bias", "user", "priority")


def _dump(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()


def _continuable(path: str, request: dict) -> bool:
    if request.get("stream") is not True or request.get("use_beam_search") or (request.get("best_of") or 1) > 1:
        return False
    if request.get("stop") or request.get("echo") or request.get("truncate_prompt_tokens") is not None:
        return False
    if any(k.startswith("guided_") or k == "structured_outputs" for k in request if request[k] is not None):
        return False  # a grammar's state is not carried over
    if (request.get("response_format") or {}).get("type", "text") != "text":
        return False
    if path == COMPLETIONS:
        prompt = request.get("prompt")
        # one prompt: a string or one list of token ids
        return isinstance(prompt, str) or (isinstance(prompt, list) and all(isinstance(t, int) for t in prompt))
    return not (request.get("tools") or request.get("functions") or request.get("logprobs")
                or request.get("top_logprobs"))


@dataclass
class Choice:
    """One choice as streamed so far: its token ids, whether it finished, its text's length."""

    ids: list[int] = field(default_factory=list)
    finished: bool = False
    text_chars: int = 0


@dataclass
class Follow:
    """One streamed generation followed event by event (start() makes one)."""

    path: str
    request: dict  # the client's body, parsed
    wants_ids: bool  # the client asked for token ids itself
    upstream_body: bytes  # what is sent upstream (token ids asked for)
    choices: dict[int, Choice] = field(default_factory=dict)
    prompt_ids: list[int] | None = None
    head: dict = field(default_factory=dict)  # id, created, model of the original stream
    usage_seen: bool = False
    done: bool = False
    held_error: bytes | None = None  # an error event that came after tokens, not relayed
    _buffer: bytes = b""

    @classmethod
    def start(cls, method: str, path: str, body: bytes) -> Follow | None:
        """A Follow for a streamed generation the front can continue; None for anything else."""
        if method != "POST" or path not in (COMPLETIONS, CHAT) or b'"stream"' not in body:
            return None
        try:
            request = json.loads(body)
        except ValueError:
            return None
        if not isinstance(request, dict) or not _continuable(path, request):
            return None
        wants_ids = request.get("return_token_ids") is True
        upstream = body if wants_ids else _dump({**request, "return_token_ids": True})
        num = request.get("n") or 1
        return cls(path, request, wants_ids, upstream, {i: Choice() for i in range(num)})

    @property
    def include_usage(self) -> bool:
        options = self.request.get("stream_options") or {}
        return bool(options.get("include_usage"))

    # -- the original stream ------------------------------------------------------------------

    def feed(self, piece: bytes) -> bytes:
        """The whole events `piece` completes, as the client gets them (an error event after
        tokens is held back: the stream is continued instead)."""
        out = bytearray()
        for event in self._events(piece):
            if event.strip() == DONE:
                if self.held_error is None:  # after a held-back error, closing() ends the stream
                    self.done = True
                    out += event + b"\n\n"
                continue
            data = self._data(event)
            if data is None:
                out += event + b"\n\n"
                continue
            if "error" in data and self.prompt_ids is not None:
                self.held_error = event + b"\n\n"  # the stream is continued where the tokens stopped
                continue
            self._note(data)
            out += self._for_client(event, data)
        return bytes(out)

    def unfinished(self) -> list[int]:
        """The choices to continue once the stream ended or broke: none after [DONE] or while the
        prompt's ids are unknown (no token event arrived: nothing reached the client to continue)."""
        if self.done or self.prompt_ids is None:
            return []
        return [i for i, c in sorted(self.choices.items()) if not c.finished]

    def _note(self, data: dict) -> None:
        if not self.head:
            self.head = {k: data[k] for k in ("id", "created", "model") if k in data}
        if data.get("usage") and not data.get("choices"):
            self.usage_seen = True
        if self.path == CHAT and data.get("prompt_token_ids") is not None:
            self.prompt_ids = list(data["prompt_token_ids"])
        for choice in data.get("choices") or ():
            state = self.choices.setdefault(choice.get("index", 0), Choice())
            if self.path == COMPLETIONS and choice.get("prompt_token_ids") is not None:
                self.prompt_ids = list(choice["prompt_token_ids"])
            state.ids += choice.get("token_ids") or ()
            text = choice.get("text") if self.path == COMPLETIONS else (choice.get("delta") or {}).get("content")
            state.text_chars += len(text or "")
            if choice.get("finish_reason") is not None:
                state.finished = True

    def _for_client(self, event: bytes, data: dict) -> bytes:
        if self.wants_ids:
            return event + b"\n\n"
        data.pop("prompt_token_ids", None)
        for choice in data.get("choices") or ():
            choice.pop("token_ids", None)
            choice.pop("prompt_token_ids", None)
        return b"data: " + _dump(data) + b"\n\n"

    # -- the continuation ---------------------------------------------------------------------

    def continuation(self, index: int) -> bytes:
        """The body of a plain streamed completion that continues choice `index`."""
        assert self.prompt_ids is not None
        self._buffer = b""  # what the broken stream left unfinished is gone with it
        choice = self.choices[index]
        body = {k: self.request[k] for k in _CARRIED if k in self.request}
        body.update(prompt=self.prompt_ids + choice.ids, stream=True, return_token_ids=True, n=1,
                    stream_options={"include_usage": False})
        limit = self.request.get("max_completion_tokens", self.request.get("max_tokens"))
        if limit is not None:
            body["max_tokens"] = max(limit - len(choice.ids), 0)
        if (least := self.request.get("min_tokens")) is not None:
            body["min_tokens"] = max(least - len(choice.ids), 0)
        if self.path == COMPLETIONS and self.request.get("logprobs") is not None:
            body["logprobs"] = self.request["logprobs"]
        return _dump(body)

    def feed_continuation(self, index: int, piece: bytes) -> bytes:
        """The events of choice `index`'s continuation `piece` completes, as events of the original
        stream (its id, model and shape, the client's choice index); its own [DONE] and usage
        are left out (closing() answers for the whole)."""
        out = bytearray()
        for event in self._events(piece):
            data = self._data(event)
            if data is None or "error" in data:
                continue  # [DONE], comments; an error: the choice stays unfinished
            for choice in data.get("choices") or ():
                out += self._as_original(index, choice)
        return bytes(out)

    def _as_original(self, index: int, choice: dict) -> bytes:
        state = self.choices[index]
        ids = choice.get("token_ids") or []
        text = choice.get("text") or ""
        if (logprobs := choice.get("logprobs")) and logprobs.get("text_offset"):
            logprobs["text_offset"] = [offset + state.text_chars for offset in logprobs["text_offset"]]
        state.ids += ids
        state.text_chars += len(text)
        finish = choice.get("finish_reason")
        state.finished = state.finished or finish is not None
        out: dict[str, Any] = {"index": index}
        if self.path == COMPLETIONS:
            out.update(text=text, logprobs=logprobs, finish_reason=finish)
        else:
            out.update(delta={"content": text} if text else {}, logprobs=None, finish_reason=finish)
        if "stop_reason" in choice:
            out["stop_reason"] = choice["stop_reason"]
        if self.wants_ids:
            out["token_ids"] = ids
        kind = "text_completion" if self.path == COMPLETIONS else "chat.completion.chunk"
        return b"data: " + _dump({**self.head, "object": kind, "choices": [out]}) + b"\n\n"

    def closing(self, failure: str = "") -> bytes:
        """The end of the spliced stream: where a choice is still unfinished, the error event the
        original sent or one naming `failure`; else the usage event if the client asked for it and
        the original did not send it; then [DONE]."""
        if any(not c.finished for c in self.choices.values()):
            error = {"error": {"message": failure or "the stream broke off and could not be continued",
                               "type": "ServiceUnavailableError", "param": None, "code": 503}}
            return (self.held_error or b"data: " + _dump(error) + b"\n\n") + DONE + b"\n\n"
        out = b""
        if self.include_usage and not self.usage_seen and self.prompt_ids is not None:
            prompt = len(self.prompt_ids)
            completion = sum(len(c.ids) for c in self.choices.values())
            kind = "text_completion" if self.path == COMPLETIONS else "chat.completion.chunk"
            usage = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
            out += b"data: " + _dump({**self.head, "object": kind, "choices": [], "usage": usage}) + b"\n\n"
        return out + DONE + b"\n\n"

    # -- server-sent events -------------------------------------------------------------------

    def _events(self, piece: bytes) -> list[bytes]:
        self._buffer += piece.replace(b"\r\n", b"\n")
        *events, self._buffer = self._buffer.split(b"\n\n")
        return [e for e in events if e.strip()]

    @staticmethod
    def _data(event: bytes) -> dict | None:
        if not event.startswith(b"data: ") or event.strip() == DONE:
            return None
        try:
            data = json.loads(event[len(b"data: "):])
        except ValueError:
            return None
        return data if isinstance(data, dict) else None
