"""Calibration: where this machine's capacity lies, so that the rate grid follows the machine.

At the start of a run, on a plain deployment (``collocated``: one vLLM instance on every core,
vLLM's default budget), measure with single HTTP requests:

* ``prefill_ms``: the latency of an ISL-token prompt with ``max_tokens=1`` (median of repeats);
* ``decode_step_ms``: one decode step of one sequence, (latency(1 + OSL) - latency(1)) / OSL;
* ``batch_step_ms``: one decode step of ``BATCH`` concurrent sequences, measured the same way.

The capacity estimate is ``1 / (prefill + OSL x m)`` req/s with m = (batch_step - decode_step) /
(BATCH - 1) the marginal cost of one more sequence in a decode step: the machine busy with
back-to-back prefills plus every output token at its marginal cost (the fixed part of a step is
shared by ever larger batches under load). Plain serving's knees lie near 0.7-0.85 of it on the
small model (the committed run), PD's lower; the presets place their rates as fractions of it.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from pdserve.bench.deployment import Endpoint
from pdserve.bench.plan import Workload
from pdserve.errors import ConfigError, LaunchError

BATCH = 8
REPEATS = 3
CALIBRATION_SEED = 31337


@dataclass(frozen=True)
class Machine:
    cpu_model: str
    num_cpus: int  # online CPUs
    num_usable_cpus: int  # in this process's affinity mask (what the deployments get)
    python: str

    def __str__(self) -> str:
        return f"{self.cpu_model}, {self.num_usable_cpus} usable of {self.num_cpus} CPUs"


@dataclass(frozen=True)
class Calibration:
    machine: Machine
    config: str  # the deployment measured
    input_len: int
    output_len: int
    prefill_ms: float
    decode_step_ms: float
    batch_step_ms: float
    batch: int

    @property
    def marginal_step_ms(self) -> float:
        """What one more sequence adds to a decode step."""
        return max(0.0, self.batch_step_ms - self.decode_step_ms) / (self.batch - 1)

    @property
    def capacity(self) -> float:
        """Estimated req/s of the whole machine (see the module docstring)."""
        return 1000.0 / (self.prefill_ms + self.output_len * self.marginal_step_ms)

    def describe(self) -> str:
        return (f"Machine: {self.machine}. Calibration on `{self.config}` (vLLM defaults): prefill of a "
                f"{self.input_len}-token prompt {self.prefill_ms:.0f} ms; decode step {self.decode_step_ms:.1f} ms "
                f"for 1 sequence, {self.batch_step_ms:.1f} ms for {self.batch} (marginal {self.marginal_step_ms:.2f} ms "
                f"a sequence); estimated capacity 1 / (prefill + {self.output_len} x marginal) = "
                f"{self.capacity:.2f} req/s.")

    def to_json(self) -> str:
        return json.dumps({**asdict(self), "marginal_step_ms": self.marginal_step_ms, "capacity": self.capacity},
                          indent=2) + "\n"

    @classmethod
    def from_json(cls, text: str) -> "Calibration":
        try:
            data = json.loads(text)
            data.pop("capacity", None)
            data.pop("marginal_step_ms", None)
            return cls(machine=Machine(**data.pop("machine")), **data)
        except (ValueError, TypeError, KeyError) as exc:
            raise ConfigError(f"unreadable calibration: {exc}") from exc


def vocab_size(model_dir: Path) -> int:
    """The model's vocabulary size (config.json), for drawing prompt token ids."""
    try:
        return int(json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"])
    except (OSError, ValueError, KeyError) as exc:
        raise ConfigError(f"cannot read vocab_size from {model_dir}/config.json: {exc}") from exc


def this_machine() -> Machine:
    model = platform.processor() or "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return Machine(model, os.cpu_count() or 0, len(os.sched_getaffinity(0)), platform.python_version())


def calibrate(endpoint: Endpoint, workload: Workload, vocab_size: int, config: str = "collocated",
              timeout_s: float = 120.0) -> Calibration:
    """Measure the deployment behind ``endpoint`` (idle, warmed up) with ``workload``'s lengths."""
    client = _Client(endpoint, workload.input_len, vocab_size, timeout_s)
    osl = workload.output_len
    prefill = [client.latency_ms(1) for _ in range(REPEATS)]
    one = [client.latency_ms(1 + osl) for _ in range(REPEATS)]
    batch_first = [client.batch_ms(1) for _ in range(REPEATS)]
    batch_full = [client.batch_ms(1 + osl) for _ in range(REPEATS)]
    p = statistics.median(prefill)
    step1 = max(0.0, statistics.median(one) - p) / osl
    step_b = max(0.0, statistics.median(batch_full) - statistics.median(batch_first)) / osl
    return Calibration(this_machine(), config, workload.input_len, osl, p, step1, max(step_b, step1), BATCH)


class _Client:
    def __init__(self, endpoint: Endpoint, input_len: int, vocab_size: int, timeout_s: float) -> None:
        self.endpoint = endpoint
        self.input_len = input_len
        self.timeout_s = timeout_s
        self._rng = np.random.default_rng(CALIBRATION_SEED)
        self._high = max(vocab_size - 1, 2)

    def latency_ms(self, max_tokens: int, prompt: list[int] | None = None) -> float:
        prompt = prompt or self._prompt()
        body = {"model": self.endpoint.model_name, "prompt": prompt, "max_tokens": max_tokens,
                "temperature": 0, "ignore_eos": True}
        request = urllib.request.Request(f"{self.endpoint.base_url}/v1/completions", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        started = time.perf_counter()
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as resp:
                json.load(resp)
        except (urllib.error.URLError, OSError, ValueError) as exc:
            raise LaunchError(f"calibration request to {self.endpoint.base_url} failed: {exc}") from exc
        return 1000.0 * (time.perf_counter() - started)

    def batch_ms(self, max_tokens: int) -> float:
        """Wall time of BATCH requests sent together."""
        prompts = [self._prompt() for _ in range(BATCH)]
        started = time.perf_counter()
        with ThreadPoolExecutor(max_workers=BATCH) as pool:
            list(pool.map(lambda prompt: self.latency_ms(max_tokens, prompt), prompts))
        return 1000.0 * (time.perf_counter() - started)

    def _prompt(self) -> list[int]:
        return self._rng.integers(1, self._high, size=self.input_len).tolist()  # a fresh prompt each time
