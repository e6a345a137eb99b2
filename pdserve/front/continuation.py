"""Mid-stream continuation: a streamed generation that breaks off after some tokens goes on elsewhere.

A streamed completion or chat completion reaches the client as server-sent events. Where the
deployment has instances to fall back to, the front asks the upstream for each token's id
(`return_token_ids`, taken out again for a client that did not ask) and follows every choice:

    request ──▶ Follow.start(path, body)  streamed generation the front follows? (else None)
    event   ──▶ Follow.feed(piece)        whole events out, as the client asked for them; ids kept
    break   ──▶ Follow.unfinished()       choices without a finish_reason when the stream broke off
            ──▶ Follow.refusal(i)         why choice i cannot be continued exactly (None: it can)
            ──▶ Follow.continuation(i, max_model_len)  POST /v1/completions body: the prompt's ids +
                                          the ids streamed, the tokens left (None: none are left)
            ──▶ Follow.feed_continuation(i, piece)  its events, rewritten as choice i of the original
            ──▶ Follow.closing()          the usage event (if asked) and [DONE], or the error event

A stream broke off when it ended (or failed) before `[DONE]`, or sent an error event after tokens,
with a choice unfinished. The continuation is a plain completion of the token ids streamed so far,
with what is left of each budget counted from the tokens already sent: `max_tokens` (absent: vLLM's
defaults, 16 for a completion, the rest of max_model_len for a chat) and `min_tokens`. For a greedy
request its tokens are those the uninterrupted run would have produced; a sampled request gets a
new draw conditioned on what the client already has. Followed but refused at the break (the stream
ends with an error event naming why, never other tokens): `frequency_penalty` or
`presence_penalty` (they count the tokens generated, which become prompt tokens elsewhere), a chat
choice inside its reasoning or before its first content, `include_reasoning: false`. Not followed
(the connection closes on a break): chat requests with tools or logprobs, requests with stop
strings, beam search or `best_of`, several prompts in one request, `echo`, structured output. Pure:
no I/O here (exchange.py sends and relays).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from pdserve.front.body import RequestBody, encode, integer, malformed

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
DONE = b"data: [DONE]"
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # vLLM 0.32's CompletionRequest.max_tokens default (also for null)
# sampling fields a continuation keeps as the client set them (the rest are the instance's defaults)
_CARRIED = ("model", "temperature", "top_p", "top_k", "min_p", "seed", "repetition_penalty", "stop_token_ids",
            "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "bad_words", "allowed_token_ids",
            "logit_bias", "user", "priority", "frequency_penalty", "presence_penalty")
_PENALTIES = ("frequency_penalty", "presence_penalty")


def _dump(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()


def _set(body: RequestBody, name: str) -> bool:
    value = body.field(name)
    return value is not None and value is not False and value != [] and value != {} and value != ""


def _continuable(path: str, body: RequestBody) -> bool:
    if body.field("stream") is not True or _set(body, "use_beam_search") or (integer(body.field("best_of", 1)) or 1) > 1:
        return False
    if _set(body, "stop") or _set(body, "echo") or body.field("truncate_prompt_tokens") is not None:
        return False
    assert body.members is not None
    if any(k.startswith("guided_") or k == "structured_outputs" for k in body.members if _set(body, k)):
        return False  # a grammar's state is not carried over
    response_format = body.field("response_format", {})
    if not isinstance(response_format, dict) or response_format.get("type", "text") != "text":
        return False
    for name in ("max_tokens", "max_completion_tokens", "min_tokens", "n"):
        if body.field(name) is not None and integer(body.field(name)) is None:
            return False  # the instance answers what is wrong with it
    if not isinstance(body.field("stream_options", {}), dict):
        return False
    if path == COMPLETIONS:
        return _one_prompt(body)
    return not (_set(body, "tools") or _set(body, "functions") or _set(body, "logprobs")
                or _set(body, "top_logprobs"))


def _one_prompt(body: RequestBody) -> bool:
    """A string or one list of token ids (told by its first bytes: a long prompt is never decoded)."""
    raw = body.raw_member("prompt")
    if raw is None:
        return False
    head = bytes(memoryview(raw)[:64]).lstrip()
    if head.startswith(b'"'):
        return True
    # a list that starts with an id is a list of ids only (vLLM's schema refuses any other)
    first = head[1:].lstrip()[:1]
    return head.startswith(b"[") and (first.isdigit() or first == b"-")


@dataclass
class Choice:
    """One choice as streamed so far: its token ids, whether it finished, its text's length, and for a
    chat choice whether its content started and whether it is inside its reasoning."""

    ids: list[int] = field(default_factory=list)
    finished: bool = False
    text_chars: int = 0
    content_started: bool = False
    reasoning: bool = False


@dataclass
class Follow:
    """One streamed generation followed event by event (start() makes one)."""

    path: str
    body: RequestBody  # the client's
    wants_ids: bool  # the client asked for token ids itself
    upstream_body: RequestBody  # what is sent upstream (token ids asked for)
    num_choices: int
    choices: dict[int, Choice] = field(default_factory=dict)  # made as their events arrive
    prompt_ids: list[int] | None = None
    head: dict = field(default_factory=dict)  # id, created, model of the original stream
    usage_seen: bool = False
    done: bool = False
    held_error: bytes | None = None  # an error event that came after tokens, not relayed
    _buffer: bytes = b""

    @classmethod
    def start(cls, method: str, path: str, body: RequestBody) -> Follow | None:
        """A Follow for a streamed generation the front can continue (or refuse at a break); None for anything else."""
        if method != "POST" or path not in (COMPLETIONS, CHAT) or not body.is_object or not _continuable(path, body):
            return None
        wants_ids = body.field("return_token_ids") is True
        upstream = body if wants_ids else body.with_members(return_token_ids=True)
        return cls(path, body, wants_ids, upstream, integer(body.field("n", 1)) or 1)

    @property
    def include_usage(self) -> bool:
        return bool(self.body.field("stream_options", {}).get("include_usage"))

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
        return [i for i in range(self.num_choices) if not self._choice(i).finished]

    def _choice(self, index: int) -> Choice:
        if index not in self.choices:
            self.choices[index] = Choice()
        return self.choices[index]

    def _note(self, data: dict) -> None:
        if not self.head:
            self.head = {k: data[k] for k in ("id", "created", "model") if k in data}
        if data.get("usage") and not data.get("choices"):
            self.usage_seen = True
        if self.path == CHAT and data.get("prompt_token_ids") is not None:
            self.prompt_ids = list(data["prompt_token_ids"])
        for choice in data.get("choices") or ():
            index = choice.get("index", 0)
            if not isinstance(index, int) or not 0 <= index < self.num_choices:
                continue
            state = self._choice(index)
            if self.path == COMPLETIONS and choice.get("prompt_token_ids") is not None:
                self.prompt_ids = list(choice["prompt_token_ids"])
            state.ids += choice.get("token_ids") or ()
            if self.path == COMPLETIONS:
                state.text_chars += len(choice.get("text") or "")
            else:
                self._note_delta(state, choice.get("delta") or {})
            if choice.get("finish_reason") is not None:
                state.finished = True

    @staticmethod
    def _note_delta(state: Choice, delta: dict) -> None:
        if delta.get("reasoning") or delta.get("reasoning_content"):
            state.reasoning = True
        if content := delta.get("content"):
            state.text_chars += len(content)
            state.content_started, state.reasoning = True, False

    def _for_client(self, event: bytes, data: dict) -> bytes:
        if self.wants_ids:
            return event + b"\n\n"
        data.pop("prompt_token_ids", None)
        for choice in data.get("choices") or ():
            choice.pop("token_ids", None)
            choice.pop("prompt_token_ids", None)
        return b"data: " + _dump(data) + b"\n\n"

    # -- the continuation ---------------------------------------------------------------------

    def refusal(self, index: int) -> str | None:
        """Why choice `index` cannot be continued with the tokens an uninterrupted run gives; None if it can."""
        broke = f"the stream broke off after {len(self._choice(index).ids)} tokens of choice {index}"
        for name in _PENALTIES:
            value = self.body.field(name)
            if value not in (None, 0) and not malformed(value):
                return (f"{broke} and is not continued: {name} counts the tokens already generated, which a "
                        "continuation would take as prompt (its tokens would differ)")
        if self.path != CHAT:
            return None
        if self.body.field("include_reasoning") is False:
            return f"{broke} and is not continued: with include_reasoning false its reasoning is not streamed"
        state = self._choice(index)
        if state.reasoning:
            return f"{broke} inside its reasoning and is not continued (the rest would come as content)"
        if not state.content_started:
            return f"{broke} before its content started and is not continued (it might begin with reasoning)"
        return None

    @property
    def needs_max_model_len(self) -> bool:
        """Whether the tokens left depend on the instance's max_model_len (a chat without a limit)."""
        return self.path == CHAT and self._limit() is None

    def _limit(self) -> int | None:
        """The client's token limit, as vLLM reads it; None: a chat's, up to max_model_len."""
        names = ("max_completion_tokens", "max_tokens") if self.path == CHAT else ("max_tokens",)
        for name in names:
            if (value := integer(self.body.field(name))) is not None:
                return value
        return COMPLETIONS_DEFAULT_MAX_TOKENS if self.path == COMPLETIONS else None

    def continuation(self, index: int, max_model_len: int | None = None) -> bytes | None:
        """The body of a plain streamed completion that continues choice `index`; None where no
        token is left to generate (finish() ends the choice). A chat without a limit needs
        `max_model_len` (needs_max_model_len)."""
        assert self.prompt_ids is not None
        self._buffer = b""  # what the broken stream left unfinished is gone with it
        choice = self._choice(index)
        limit = self._limit()
        if limit is None:
            assert max_model_len is not None, "a chat without a limit continues up to max_model_len"
            limit = max_model_len - len(self.prompt_ids)
        left = limit - len(choice.ids)
        if left <= 0:
            return None
        assert self.body.members is not None
        body: dict[str, Any] = {k: self.body.members[k] for k in _CARRIED if k in self.body.members}
        body.update(prompt=self.prompt_ids + choice.ids, stream=True, return_token_ids=True, n=1,
                    stream_options={"include_usage": False}, max_tokens=left)
        if (least := integer(self.body.field("min_tokens"))) is not None:
            body["min_tokens"] = min(max(least - len(choice.ids), 0), left)
        if self.path == COMPLETIONS and self.body.field("logprobs") is not None:
            body["logprobs"] = self.body.field("logprobs")
        return encode(body)

    def finish(self, index: int, reason: str = "length") -> bytes:
        """An event ending choice `index` with `reason` and no more text (its budget was spent at the break)."""
        return self._as_original(index, {"text": "", "token_ids": [], "finish_reason": reason})

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
        state = self._choice(index)
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

    def closing(self, failure: str = "", refused: bool = False) -> bytes:
        """The end of the spliced stream: where a choice is still unfinished, the error event the
        original sent or one naming `failure` (`refused`: always `failure`, the refusal's reason);
        else the usage event if the client asked for it and the original did not send it; then [DONE]."""
        if self.unfinished_any():
            error = {"error": {"message": failure or "the stream broke off and could not be continued",
                               "type": "ServiceUnavailableError", "param": None, "code": 503}}
            event = b"data: " + _dump(error) + b"\n\n"
            return (event if refused else self.held_error or event) + DONE + b"\n\n"
        out = b""
        if self.include_usage and not self.usage_seen and self.prompt_ids is not None:
            prompt = len(self.prompt_ids)
            completion = sum(len(c.ids) for c in self.choices.values())
            kind = "text_completion" if self.path == COMPLETIONS else "chat.completion.chunk"
            usage = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
            out += b"data: " + _dump({**self.head, "object": kind, "choices": [], "usage": usage}) + b"\n\n"
        return out + DONE + b"\n\n"

    def unfinished_any(self) -> bool:
        return any(not self._choice(i).finished for i in range(self.num_choices))

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
