"""`pdserve up` options, parsed once into a frozen dataclass."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, get_args

from pdserve.errors import ConfigError
from pdserve.slo import SLO

GIB = 1 << 30
DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 18000
DEFAULT_DRAIN_TIMEOUT = 30.0
MAX_INSTANCES_PER_ROLE = 16
MAX_TP = 64  # the largest tensor-parallel size of an instance
TP_FLAGS = ("--tensor-parallel-size", "-tp")  # vLLM's, which pdserve sets itself (see refuse_tp_flag)
ADAPTIVE_MODES = ("adaptive", "adaptive-read")  # the modes with per-request placement
RestartPolicy = Literal["on-failure", "never"]
RESTART_POLICIES: tuple[str, ...] = get_args(RestartPolicy)


def check_restart_policy(policy: str) -> None:
    """on-failure: restart a process that dies once the deployment is healthy; never: report it."""
    if policy not in RESTART_POLICIES:
        raise ConfigError(f"unknown restart policy {policy!r} (known: {', '.join(RESTART_POLICIES)})")


def all_cores() -> tuple[int, ...]:
    return tuple(sorted(os.sched_getaffinity(0)))


@dataclass(frozen=True)
class UpOptions:
    """Everything a mode needs to plan a deployment.

    `host` is the address the client-facing front listens on; instances and router stay on
    loopback. `port` is the front's port; instances take the ports after it. `model` is a
    directory, a Hugging Face id or a built-in name (tiny, small, ...), resolved by launch.up().
    `restart`: what the cluster does when a process dies after it was healthy (RESTART_POLICIES).
    `drain_timeout`: on stop, how long requests in flight may take to finish (new ones are
    refused meanwhile); 0 cuts them off at once.
    `num_prefill`, `num_decode`: how many prefill and decode instances a PD mode runs (xPyD); a
    mode with a fixed shape refuses other numbers (see modes.plan).
    `prefill_tp`, `decode_tp`: the tensor-parallel size of each prefill and decode instance of a PD
    mode; `kv_cache_bytes` stays the instance's, divided among its ranks (see vllm_args).
    """

    mode: str = "collocated"
    model: str = "tiny"
    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT
    kv_cache_bytes: int = GIB
    max_model_len: int = 4096
    prefix_caching: bool = True
    enforce_eager: bool = False
    extra_vllm_args: tuple[str, ...] = ()
    cores: tuple[int, ...] = field(default_factory=all_cores)
    startup_timeout: float = 600.0
    log_dir: Path | None = None
    restart: RestartPolicy = "on-failure"
    drain_timeout: float = DEFAULT_DRAIN_TIMEOUT
    prefill_budget: int | None = None  # --max-num-batched-tokens of prefill instances (None: vLLM's default)
    decode_budget: int | None = None  # ... of decode instances
    decode_chunk: int | None = None  # --long-prefill-token-threshold of decode instances: one prompt's tokens a step
    prefill_chunk: int | None = None  # ... of prefill instances
    itl_target_ms: float | None = None  # adaptive placement: decode prefills locally only within this mean ITL
    max_step_ms: float | None = None  # ... and while one chunk step takes no longer than this
    slo: str | None = None  # adaptive placement: the declared SLO, instead of the two above (placement/slo_targets.py)
    serve_decode: bool = False  # adaptive placement: the prefill instance serves whole requests too
    kv_verify: str | None = None  # the connector's kv_verify, "digest" | "off" (None: its default)
    num_prefill: int = 1
    num_decode: int = 1
    prefill_tp: int = 1
    decode_tp: int = 1

    def __post_init__(self) -> None:
        check_restart_policy(self.restart)
        if not 1 <= self.port <= 65535 - 16:
            raise ConfigError(f"--port: a port in 1..{65535 - 16}, the instances taking the next ones (got {self.port})")
        if not 0 <= self.drain_timeout < float("inf"):
            raise ConfigError(f"--drain-timeout: a drain timeout is a number of seconds >= 0 (got {self.drain_timeout})")
        if not 0 < self.startup_timeout < float("inf"):
            raise ConfigError(f"--startup-timeout: a number of seconds > 0 (got {self.startup_timeout})")
        if self.kv_cache_bytes < 16 << 20:
            raise ConfigError(f"--kv-cache: at least 16MiB (got {self.kv_cache_bytes} bytes)")
        if not 16 <= self.max_model_len <= 1 << 20:
            raise ConfigError(f"--max-model-len: a token count in 16..{1 << 20} (got {self.max_model_len})")
        if not self.cores:
            raise ConfigError("no CPU cores to run on")
        for name, count in (("prefill", self.num_prefill), ("decode", self.num_decode)):
            if not 1 <= count <= MAX_INSTANCES_PER_ROLE:
                raise ConfigError(f"--{name}: {count} {name} instances: give 1..{MAX_INSTANCES_PER_ROLE}")
        for flag, tp in (("--prefill-tp", self.prefill_tp), ("--decode-tp", self.decode_tp)):
            check_tp(flag, tp)
        refuse_tp_flag(self.extra_vllm_args, "--prefill-tp / --decode-tp")
        for name, budget in (("prefill", self.prefill_budget), ("decode", self.decode_budget),
                             ("decode chunk", self.decode_chunk), ("prefill chunk", self.prefill_chunk)):
            if budget is not None and not 16 <= budget <= 1 << 20:
                raise ConfigError(f"{name} budget {budget} is not a token count in 16..{1 << 20}")
        if self.kv_verify not in (None, "digest", "off"):
            raise ConfigError(f"--kv-verify: digest or off (got {self.kv_verify!r})")
        if self.kv_verify is not None and self.mode in ("collocated", "round-robin", "nixl"):
            raise ConfigError(f"--kv-verify: pdserve's PD modes only (PDConnector moves KV), not {self.mode}")
        if self.serve_decode and self.mode != "adaptive":
            raise ConfigError(f"--prefill-serves-decode: only in adaptive mode (WRITE), not {self.mode}")
        if self.serve_decode and self.num_prefill != 1:
            raise ConfigError(f"--prefill-serves-decode: only when it is the only one, as the router pairs a "
                              f"request's legs across instances (got --prefill {self.num_prefill})")
        if self.slo is not None:
            self._check_slo()
        for name, ms in (("ITL target", self.itl_target_ms), ("largest step", self.max_step_ms)):
            if ms is not None and not 0 < ms < 1e6:
                raise ConfigError(f"{name} {ms} ms is not a positive number of milliseconds")

    def _check_slo(self) -> None:
        if self.mode not in ADAPTIVE_MODES:
            raise ConfigError(f"--slo is what adaptive placement protects: {' or '.join(ADAPTIVE_MODES)} mode only, "
                              f"not {self.mode}")
        if self.itl_target_ms is not None or self.max_step_ms is not None:
            raise ConfigError("give --slo or --itl-target-ms / --max-step-ms, not both: the SLO sets them")
        SLO.parse(self.slo)  # a clear error here rather than from every instance

    def tp(self, role: str) -> int:
        """The tensor-parallel size of an instance of `role` (prefill|decode|both)."""
        return {"prefill": self.prefill_tp, "decode": self.decode_tp}.get(role, 1)

    def budget_args(self, role: str) -> tuple[str, ...]:
        """`--max-num-batched-tokens` (and a decode instance's `--long-prefill-token-threshold`) for an
        instance of `role` (prefill|decode|both), where set."""
        budget = {"prefill": self.prefill_budget, "decode": self.decode_budget}.get(role)
        args = () if budget is None else ("--max-num-batched-tokens", str(budget))
        chunk = {"prefill": self.prefill_chunk, "decode": self.decode_chunk}.get(role)
        if chunk is not None:
            args += ("--long-prefill-token-threshold", str(chunk))
        return args

    def vllm_args(self, role: str = "both") -> tuple[str, ...]:
        """Flags every vLLM instance of a launch shares, for an instance of `role`: vLLM's
        --kv-cache-memory-bytes is per rank, so the instance's KV cache is divided among its ranks
        (the same number of blocks whatever its tensor-parallel size)."""
        args = ["--dtype", "bfloat16", "--max-model-len", str(self.max_model_len),
                "--kv-cache-memory-bytes", str(self.kv_cache_bytes // self.tp(role)),
                "--uvicorn-log-level", "warning"]
        args.append("--enable-prefix-caching" if self.prefix_caching else "--no-enable-prefix-caching")
        if self.enforce_eager:
            args.append("--enforce-eager")
        return (*args, *self.extra_vllm_args)


def check_tp(flag: str, tp: int) -> None:
    if not 1 <= tp <= MAX_TP:
        raise ConfigError(f"{flag}: a tensor-parallel size in 1..{MAX_TP} (got {tp})")


def refuse_tp_flag(vllm_args: tuple[str, ...], instead: str) -> None:
    """vLLM's own tensor-parallel flag is refused: the launcher must know each instance's size to give
    every rank its cores and its handshake and notify ports."""
    for arg in vllm_args:
        if arg.split("=", 1)[0] in TP_FLAGS:
            raise ConfigError(f"{arg} among vLLM's flags: give {instead} instead, which also pins each rank to its "
                              "cores and gives it its ports")


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)\s*$", re.IGNORECASE)


def parse_bytes(text: str) -> int:
    """'1GiB', '512M', '1073741824' -> bytes (binary units)."""
    match = _SIZE.match(text)
    if not match:
        raise ConfigError(f"cannot read {text!r} as a size (e.g. 1GiB, 512MiB)")
    number, unit = float(match.group(1)), match.group(2).lower()
    return int(number * (1 << (10 * " kmgt".index(unit or " "))))
