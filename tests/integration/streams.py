"""Streams read on their own threads, and the requests whose continuation after a death is checked
(test_availability.py)."""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field

import requests

from pdserve.compare import parse_stream

MAX_MODEL_LEN = 4096  # pd_helpers.options: UpOptions' default
LONG_MESSAGE = "hello " * 1900  # ~3,820 prompt tokens: a chat without max_tokens ends ~270 tokens later
PROMPT = [17, 230, 1999, 42, 7, 301, 88, 1234, 5, 66]


@dataclass
class Stream:
    """One streamed request read on its own thread: its events, its token ids by choice."""

    path: str
    body: dict
    events: list = field(default_factory=list)
    ids: dict[int, list[int]] = field(default_factory=dict)
    finish: dict[int, str] = field(default_factory=dict)
    errors: list[dict] = field(default_factory=list)
    prompt_ids: list[int] = field(default_factory=list)
    done: bool = False
    failure: str = ""

    @property
    def num_choices(self) -> int:
        return self.body.get("n", 1)

    def fewest_tokens(self) -> int:
        return min(len(self.ids.get(i, ())) for i in range(self.num_choices))

    def read(self, url: str) -> None:
        try:
            with requests.post(f"{url}{self.path}", json=self.body, stream=True, timeout=600) as response:
                if response.status_code != 200:
                    self.failure = f"{response.status_code} {response.text}"
                    return
                for line in response.iter_lines(chunk_size=None):
                    if line == b"data: [DONE]":
                        self.done = True
                    elif line.startswith(b"data: "):
                        self._note(json.loads(line[len(b"data: "):]))
        except requests.RequestException as exc:
            self.failure = repr(exc)

    def generation(self, index: int):
        """Choice `index` as a Generation (a completion's, asked with logprobs 2): compare_greedy's terms."""
        return parse_stream([{"choices": [c]} for e in self.events for c in e.get("choices") or ()
                             if c["index"] == index and c.get("token_ids")])

    def _note(self, event: dict) -> None:
        self.events.append(event)
        if "error" in event:
            self.errors.append(event["error"])
        self.prompt_ids = event.get("prompt_token_ids") or self.prompt_ids
        for choice in event.get("choices") or ():
            self.prompt_ids = choice.get("prompt_token_ids") or self.prompt_ids
            self.ids.setdefault(choice["index"], []).extend(choice.get("token_ids") or ())
            if choice.get("finish_reason") is not None:
                self.finish[choice["index"]] = choice["finish_reason"]


def cases(model: str) -> dict[str, Stream]:
    def completion(**body) -> Stream:
        return Stream("/v1/completions", {"model": model, "prompt": PROMPT, "temperature": 0, "stream": True,
                                          "return_token_ids": True, "logprobs": 2, **body})

    def chat(**body) -> Stream:
        return Stream("/v1/chat/completions", {"model": model, "messages": [{"role": "user", "content": LONG_MESSAGE}],
                                               "temperature": 0, "stream": True, "return_token_ids": True, **body})

    return {
        "chat, no max_tokens": chat(ignore_eos=True),
        "chat, min_tokens, no max_tokens": chat(min_tokens=200),
        # vLLM 0.32 refuses n > 1 at temperature 0; top_k 1 keeps the best token, and all tokens tied with it
        # in bfloat16 (then drawn at random: compare_greedy lets runs part at such a near-tie)
        "completion, n=3 (top_k 1)": completion(n=3, temperature=1.0, top_k=1, max_tokens=120, ignore_eos=True),
        "completion, penalties": completion(frequency_penalty=0.5, presence_penalty=0.3, max_tokens=120,
                                            ignore_eos=True),
        "completion, no max_tokens": completion(ignore_eos=True),  # 16 tokens: started last
    }


def start(stream: Stream, url: str) -> threading.Thread:
    thread = threading.Thread(target=stream.read, args=(url,), daemon=True)
    thread.start()
    return thread


def wait_until(condition, what: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.005)
