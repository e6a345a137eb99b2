"""Runs one `vllm bench serve` point as a child process group, with a deadline.

The client runs in its own session so that stopping it (deadline, Ctrl-C) reaches every process
it spawned. Its result is written under a temporary name and renamed only when the client exited
cleanly with a detailed result, so a results directory never holds a half-written point.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from pdserve.bench.plan import PROMPT_CHUNK_TOKENS, Workload
from pdserve.bench.records import load_bench_run
from pdserve.bench.trace import write_trace
from pdserve.errors import ConfigError, PDServeError


class BenchClientError(PDServeError):
    """`vllm bench serve` failed, timed out, or wrote no usable result."""


@dataclass(frozen=True)
class BenchCommand:
    """Everything one invocation needs; ``argv`` is the exact command line.

    The client replays the trace of (workload, seed, rate) that ``trace.write_trace`` writes to
    ``trace_path`` just before it starts."""

    base_url: str
    model_name: str  # the served model id (from /v1/models)
    tokenizer: Path
    workload: Workload
    rate: float
    seed: int  # the arrival seed: the same stream at every rate and in every configuration
    result_path: Path
    trace_path: Path

    @property
    def expected_s(self) -> float:
        """Arrival span of the point (about N / rate)."""
        return self.workload.num_prompts / self.rate

    def argv(self, result_file: Path) -> list[str]:
        w = self.workload
        return [
            sys.executable, "-m", "pdserve.vllm_cli", "bench", "serve",
            "--backend", "openai", "--endpoint", "/v1/completions", "--base-url", self.base_url,
            "--model", self.model_name, "--tokenizer", str(self.tokenizer),
            "--dataset-name", "timed_trace", "--dataset-path", str(self.trace_path),
            "--timed-trace-chunk-hash-size", str(PROMPT_CHUNK_TOKENS), "--num-prompts", str(w.num_prompts),
            "--seed", str(self.seed), "--ignore-eos", "--temperature", "0", "--num-warmups", "0",
            "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99",
            "--disable-tqdm", "--save-result", "--save-detailed",
            "--result-dir", str(result_file.parent), "--result-filename", result_file.name,
        ]


# the client seeds each prompt chunk's tokens with hash() of its id: fixed, so prompts repeat exactly
CLIENT_ENV = {"PYTHONHASHSEED": "0"}


def run_bench(command: BenchCommand, log_path: Path, tick: Callable[[float], None] = lambda _: None,
              startup_s: float = 120.0) -> None:
    """Run the point; ``tick(elapsed_s)`` is called about once a second while it runs.

    Raises BenchClientError on failure or when it outlives 3x its arrival span plus ``startup_s``;
    KeyboardInterrupt propagates after the client's process group is gone.
    """
    partial = command.result_path.with_name(command.result_path.name + ".part")
    partial.parent.mkdir(parents=True, exist_ok=True)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    partial.unlink(missing_ok=True)
    deadline_s = startup_s + 3 * command.expected_s
    write_trace(command.trace_path, command.workload, command.seed, command.rate)
    with open(log_path, "ab") as log:
        log.write(("$ " + " ".join(command.argv(partial)) + "\n").encode())
        log.flush()
        child = subprocess.Popen(command.argv(partial), stdin=subprocess.DEVNULL, stdout=log,
                                 stderr=subprocess.STDOUT, start_new_session=True,
                                 env={**os.environ, **CLIENT_ENV})
    started = time.monotonic()
    try:
        while child.poll() is None:
            elapsed = time.monotonic() - started
            if elapsed > deadline_s:
                raise BenchClientError(f"vllm bench serve ran past its {deadline_s:.0f} s deadline (log: {log_path})")
            tick(elapsed)
            time.sleep(min(1.0, max(0.05, deadline_s - elapsed)))
    finally:
        stop_group(child)
    if child.returncode != 0:
        raise BenchClientError(f"vllm bench serve exited with {child.returncode} (log: {log_path})")
    try:
        load_bench_run(partial)
    except ConfigError as exc:
        raise BenchClientError(f"vllm bench serve wrote no usable result: {exc}") from exc
    os.replace(partial, command.result_path)


def stop_group(child: subprocess.Popen, grace_s: float = 5.0) -> None:
    """SIGTERM the child's process group, SIGKILL it after ``grace_s``; a no-op once it is gone."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(child.pid, sig)
        except ProcessLookupError:
            break
        try:
            child.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            continue
        try:  # the leader is gone; make sure nothing else of its group lingers
            os.killpg(child.pid, 0)
        except ProcessLookupError:
            break
