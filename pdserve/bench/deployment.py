"""How the bench brings a configuration up and down: the one place that talks to the launcher.

A configuration name maps to a launcher mode (``chunked`` is round-robin with a small
--max-num-batched-tokens) plus its token budgets (budget.py): plain configurations pass theirs to
every instance, PD ones per role (UpOptions.prefill_budget / decode_budget). Prefix caching is
off unless the workload shares prefixes, so no point benefits from another's prompts. The
``adaptive@NAME`` is adaptive declaring one of the plan's SLOs. The
``*-two-host`` configurations run the same UpOptions across two network namespaces instead
(two_host_deployment.py); ``LauncherDeployer`` (launcher_deployer.py) is the one place that tells them apart.
"""

from __future__ import annotations

import contextlib
import json
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from pdserve.bench.budget import PLAIN_CONFIGS, TWO_HOST_CONFIGS, TWO_HOST_SUFFIX, Budget, base_config
from pdserve.errors import ConfigError, LaunchError
from pdserve.launch.options import UpOptions


@dataclass(frozen=True)
class DeploymentRequest:
    """One configuration to bring up for a run of points."""

    config: str
    model_dir: Path
    log_dir: Path
    budget: Budget = Budget()
    prefix_caching: bool = False
    slo: str | None = None  # adaptive@NAME: the SLO it declares (``pdserve up --slo``)

    @property
    def mode(self) -> str:
        return "round-robin" if self.config == "chunked" else base_config(self.config).removesuffix(TWO_HOST_SUFFIX)

    @property
    def two_host(self) -> bool:
        """Whether P and D run in two network namespaces (two_host_deployment.py)."""
        return self.config in TWO_HOST_CONFIGS

    @property
    def extra_vllm_args(self) -> tuple[str, ...]:
        if self.config in PLAIN_CONFIGS and self.budget.prefill is not None:
            return ("--max-num-batched-tokens", str(self.budget.prefill))
        return ()

    @property
    def role_budgets(self) -> tuple[int | None, int | None]:
        """(prefill, decode) budgets for the launcher's PD modes; (None, None) for plain ones."""
        if self.config in PLAIN_CONFIGS:
            return None, None
        return self.budget.prefill, self.budget.decode

    def up_options(self, port: int, startup_timeout_s: float) -> UpOptions:
        """What the launcher gets for this configuration, on one host or across two."""
        prefill_budget, decode_budget = self.role_budgets
        return UpOptions(mode=self.mode, model=str(self.model_dir), port=port, prefix_caching=self.prefix_caching,
                         extra_vllm_args=self.extra_vllm_args, prefill_budget=prefill_budget,
                         decode_budget=decode_budget, serve_decode=self.budget.serve_decode,
                         slo=self.slo, log_dir=self.log_dir,
                         startup_timeout=startup_timeout_s)


@dataclass(frozen=True)
class Endpoint:
    base_url: str  # http://127.0.0.1:PORT of the router (or the single instance, or a relay to the router)
    model_name: str  # the served model id
    instance_urls: tuple[str, ...] = ()  # each vLLM instance's own base URL (its /metrics), where reachable


class Deployer(Protocol):
    """Brings configurations up one at a time; ``up`` stops everything on exit, also on Ctrl-C."""

    def unavailable(self, config: str) -> str | None:
        """Why ``config`` cannot be deployed (None if it can); checked before anything starts."""

    def up(self, request: DeploymentRequest) -> contextlib.AbstractContextManager[Endpoint]: ...


def served_model(base_url: str, timeout_s: float = 10.0) -> str:
    """The first model id that ``GET /v1/models`` lists."""
    try:
        with urllib.request.urlopen(f"{base_url}/v1/models", timeout=timeout_s) as resp:
            return json.load(resp)["data"][0]["id"]
    except (urllib.error.URLError, OSError, ValueError, KeyError, IndexError) as exc:
        raise LaunchError(f"{base_url}/v1/models did not name a model: {exc}") from exc


BENCH_PORT = 18800  # client-facing port; instances and router take the next few


def expect_model(base_url: str, model_dir: Path) -> str:
    """The served model id, checked to be ours: another deployment on the same port (a concurrent
    run) would otherwise be measured in our place."""
    return check_model(served_model(base_url), model_dir, base_url)


def check_model(served: str, model_dir: Path, where: str) -> str:
    """`served` (the model id `where` answered), if it is `model_dir`; LaunchError otherwise."""
    if served != str(Path(model_dir).resolve()):
        raise LaunchError(f"{where} serves {served!r}, not {model_dir}: is another deployment using this port?")
    return served


def check_available(deployer: Deployer, configs: tuple[str, ...]) -> None:
    """Raise ConfigError naming every requested configuration that cannot run: none is skipped."""
    problems = [f"{c}: {why}" for c in configs if (why := deployer.unavailable(c))]
    if problems:
        raise ConfigError("requested configurations are not available: " + "; ".join(problems))
