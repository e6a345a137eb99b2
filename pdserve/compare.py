"""Greedy-output comparison between two runs, and fetching the data from an OpenAI endpoint.

Rule: two runs agree when greedy tokens are equal step by step, except they may part at a step
where the reference's top-2 logprobs are within `tol` (a near-tie: compare no further in that
prompt), and logprobs of equal tokens differ by at most `tol`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import requests

DEFAULT_TOL = 0.15


@dataclass(frozen=True)
class Step:
    """One greedy step: the chosen token, its logprob, and the two best logprobs at that step."""

    token_id: int
    logprob: float
    top2: tuple[float, float]

    @property
    def gap(self) -> float:
        return self.top2[0] - self.top2[1]


Generation = list[Step]


@dataclass(frozen=True)
class PromptComparison:
    index: int
    num_compared: int            # steps whose tokens were equal and checked
    parted_at: int | None        # step where tokens differ at a near-tie of the reference
    mismatch: str | None         # why this prompt disagrees, None when it agrees
    max_logprob_diff: float

    @property
    def ok(self) -> bool:
        return self.mismatch is None


@dataclass(frozen=True)
class ComparisonResult:
    prompts: tuple[PromptComparison, ...]

    @property
    def ok(self) -> bool:
        return all(p.ok for p in self.prompts)

    @property
    def max_logprob_diff(self) -> float:
        return max((p.max_logprob_diff for p in self.prompts), default=0.0)

    @property
    def mismatches(self) -> list[str]:
        return [f"prompt {p.index}: {p.mismatch}" for p in self.prompts if p.mismatch]

    def summary(self) -> str:
        parted = sum(p.parted_at is not None for p in self.prompts)
        steps = sum(p.num_compared for p in self.prompts)
        state = "agree" if self.ok else f"DISAGREE ({'; '.join(self.mismatches)})"
        return (f"{state}: {len(self.prompts)} prompts, {steps} equal steps, {parted} parted at near-ties, "
                f"max |logprob diff| {self.max_logprob_diff:.4f}")


def compare_prompt(index: int, reference: Generation, candidate: Generation, tol: float) -> PromptComparison:
    max_diff = 0.0
    for step, (ref, cand) in enumerate(zip(reference, candidate)):
        if ref.token_id != cand.token_id:
            if ref.gap <= tol:
                return PromptComparison(index, step, step, None, max_diff)
            return PromptComparison(index, step, None, f"step {step}: token {cand.token_id} != {ref.token_id} "
                                    f"(reference top-2 gap {ref.gap:.3f} > {tol})", max_diff)
        diff = abs(ref.logprob - cand.logprob)
        max_diff = max(max_diff, diff)
        if diff > tol:
            return PromptComparison(index, step, None, f"step {step}: logprob {cand.logprob:.3f} vs "
                                    f"{ref.logprob:.3f} differs by {diff:.3f} > {tol}", max_diff)
    if len(reference) != len(candidate):
        return PromptComparison(index, min(len(reference), len(candidate)), None,
                                f"lengths differ: {len(candidate)} vs {len(reference)} steps", max_diff)
    return PromptComparison(index, len(reference), None, None, max_diff)


def compare_greedy(reference: Sequence[Generation], candidate: Sequence[Generation],
                   tol: float = DEFAULT_TOL) -> ComparisonResult:
    """Compare per-prompt greedy generations (same prompts, same order)."""
    if len(reference) != len(candidate):
        raise ValueError(f"{len(candidate)} candidate prompts for {len(reference)} reference prompts")
    return ComparisonResult(tuple(compare_prompt(i, r, c, tol) for i, (r, c) in enumerate(zip(reference, candidate))))


def parse_choice(choice: dict) -> Generation:
    """A /v1/completions choice requested with logprobs=2 and return_token_ids=true -> Generation."""
    logprobs = choice["logprobs"]
    steps = []
    for token_id, logprob, top in zip(choice["token_ids"], logprobs["token_logprobs"], logprobs["top_logprobs"]):
        best = sorted(top.values(), reverse=True) + [-math.inf, -math.inf]
        steps.append(Step(int(token_id), float(logprob), (float(best[0]), float(best[1]))))
    return steps


def parse_stream(events: Sequence[dict]) -> Generation:
    """The events of one streamed /v1/completions choice (logprobs=2, return_token_ids=true), its
    usage event allowed, as one Generation."""
    choices = [c for e in events for c in e.get("choices") or ()]
    return parse_choice({"token_ids": [t for c in choices for t in c["token_ids"]],
                         "logprobs": {k: [v for c in choices for v in c["logprobs"][k]]
                                      for k in ("token_logprobs", "top_logprobs")}})


def fetch_greedy(base_url: str, prompts: Sequence[str | list[int]], max_tokens: int = 16,
                 concurrency: int = 1, model: str | None = None, timeout: float = 300.0,
                 extra_body: dict | None = None) -> list[Generation]:
    """Greedy generations (temperature 0, ignore_eos) for each prompt, `concurrency` requests at a time.

    A prompt is text or a list of token ids. `extra_body` is merged into every request.
    """
    if model is None:
        models = requests.get(f"{base_url}/v1/models", timeout=timeout)
        models.raise_for_status()
        model = models.json()["data"][0]["id"]

    def one(prompt: str | list[int]) -> Generation:
        body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "logprobs": 2,
                "return_token_ids": True, "ignore_eos": True, **(extra_body or {})}
        response = requests.post(f"{base_url}/v1/completions", json=body, timeout=timeout)
        response.raise_for_status()
        return parse_choice(response.json()["choices"][0])

    with ThreadPoolExecutor(max(1, concurrency)) as pool:
        return list(pool.map(one, prompts))
