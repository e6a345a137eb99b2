"""Deployment modes: a registry from mode name to a planning function.

A mode is one function `plan(options) -> Deployment` decorated with `@register("name")`; it
decides the instances (ports, cores, extra vLLM args/env) and the router. Its one-line
description (`register(name, description)`, else the first line of the function's docstring) is
what `pdserve up --help` shows. Modules outside this file register the same way; list them in
PLUGIN_MODULES so `pdserve up --mode` sees them.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable
from dataclasses import dataclass

from pdserve.errors import ConfigError
from pdserve.launch.front_spec import FrontSpec, direct_sources, fallback_sources
from pdserve.launch.instance import InstanceSpec
from pdserve.launch.options import DEFAULT_HOST, UpOptions
from pdserve.launch.router import RouterSpec
from pdserve.launch.shm_namespace import tmpfs_bytes


@dataclass(frozen=True)
class Deployment:
    """What a launch runs. The client endpoint is the front when there is one (plan() adds it),
    else the router when there is one, else the only instance."""

    instances: tuple[InstanceSpec, ...]
    router: RouterSpec | None = None
    extra_ports: tuple[int, ...] = ()  # other ports the launch binds (PD control plane, discovery)
    front: FrontSpec | None = None
    warnings: tuple[str, ...] = ()  # for the user, once, at start (e.g. instances sharing cores)

    @property
    def endpoint(self) -> str:
        return self.front.url if self.front else self.backend.url

    @property
    def client_port(self) -> int:
        return (self.front or self.backend).port

    @property
    def backend(self) -> RouterSpec | InstanceSpec:
        """What serves the clients' requests (behind the front): the router, or the only instance."""
        return self.router or self.instances[0]

    @property
    def ports(self) -> tuple[int, ...]:
        ports = [i.port for i in self.instances]
        if self.router:
            ports += [self.router.port, self.router.prometheus_port]
        return (*ports, *self.extra_ports, *([self.front.port] if self.front else []))


def with_front(deployment: Deployment, drain_timeout: float, host: str = DEFAULT_HOST) -> Deployment:
    """Put a front listening on `host` on the client port the planner gave its router (or only
    instance), and move that one to the first port after all the others the deployment uses. Behind
    a router, the front knows every instance to fall back on while one is down (front/instances.py)."""
    spare = max(deployment.ports) + 1
    if deployment.router:
        moved = dataclasses.replace(deployment, router=dataclasses.replace(deployment.router, port=spare))
    else:
        first, *rest = deployment.instances
        moved = dataclasses.replace(deployment, instances=(dataclasses.replace(first, port=spare), *rest))
    upstream = (moved.backend.name, moved.backend.url)
    sources = tuple((i.name, i.url) for i in moved.instances)
    front = FrontSpec(deployment.backend.port, upstream, sources, drain_timeout, host=host,
                      direct_sources=direct_sources(moved.instances),
                      fallback_sources=fallback_sources(moved.instances) if moved.router else ())
    return dataclasses.replace(moved, front=front)


Planner = Callable[[UpOptions], Deployment]


@dataclass(frozen=True)
class Mode:
    name: str
    planner: Planner
    description: str


MODES: dict[str, Mode] = {}
PLUGIN_MODULES = ("pdserve.launch.pd_modes", "pdserve.launch.nixl_mode")  # optional modules that register PD modes


def register(name: str, description: str = "") -> Callable[[Planner], Planner]:
    """Decorator: make `planner` the mode `name`; a mode without a description is refused."""
    def add(planner: Planner) -> Planner:
        text = description or (planner.__doc__ or "").strip().split("\n", 1)[0]
        if not text:
            raise ValueError(f"mode {name!r} needs a description (argument or docstring)")
        MODES[name] = Mode(name, planner, text)
        return planner
    return add


def _load_plugins() -> None:
    for module in PLUGIN_MODULES:
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name != module:
                raise


def known_modes() -> list[str]:
    _load_plugins()
    return sorted(MODES)


def mode_descriptions() -> dict[str, str]:
    """Every registered mode's one-line description, by name, sorted."""
    _load_plugins()
    return {name: MODES[name].description for name in sorted(MODES)}


def plan(options: UpOptions) -> Deployment:
    """The mode's deployment, with a front on `options.port` (see with_front)."""
    _load_plugins()
    try:
        planner = MODES[options.mode].planner
    except KeyError:
        raise ConfigError(f"unknown mode {options.mode!r} (known: {', '.join(sorted(MODES))})") from None
    deployment = planner(options)
    _check_shape(options, deployment)
    _check_tp(options, deployment)
    if len(set(deployment.ports)) != len(deployment.ports):
        raise ConfigError(f"mode {options.mode!r} planned one port twice: {deployment.ports}")
    if deployment.front is None and deployment.backend.port == options.port:
        deployment = with_front(deployment, options.drain_timeout, options.host)
    return deployment


def _check_shape(options: UpOptions, deployment: Deployment) -> None:
    """--prefill/--decode other than 1 are refused by a mode that does not run that many."""
    if (options.num_prefill, options.num_decode) == (1, 1):
        return
    counts = {role: sum(i.role == role for i in deployment.instances) for role in ("prefill", "decode")}
    if (counts["prefill"], counts["decode"]) != (options.num_prefill, options.num_decode):
        raise ConfigError(f"mode {options.mode!r} runs {counts['prefill']} prefill and {counts['decode']} decode "
                          f"instances; --prefill {options.num_prefill} --decode {options.num_decode} is for the "
                          "modes that run several (write, read)")


def _check_tp(options: UpOptions, deployment: Deployment) -> None:
    """--prefill-tp/--decode-tp other than 1 are refused by a mode whose instances of that role do
    not run with it (a mode without prefill and decode instances: collocated, round-robin)."""
    for role in ("prefill", "decode"):
        tp = options.tp(role)
        if tp != 1 and {i.tp for i in deployment.instances if i.role == role} != {tp}:
            raise ConfigError(f"--{role}-tp: a tensor-parallel size other than 1 is for the {role} instances of the PD "
                              f"modes (write, read, adaptive, adaptive-read, nixl), not {options.mode} (got {tp})")


def plain_instance(options: UpOptions, name: str, port: int, cores: tuple[int, ...], role: str = "both") -> InstanceSpec:
    """A vLLM instance with the launch's shared flags and the role's tensor-parallel size; modes add
    their own flags via dataclasses.replace."""
    tp = options.tp(role)
    return InstanceSpec(name=name, role=role, port=port, model=options.model, cores=cores,
                        vllm_args=(*options.vllm_args(role), *options.budget_args(role)),
                        shm_limit_bytes=tmpfs_bytes(options.kv_cache_bytes, tp), tp=tp)


@register("collocated", "one plain vLLM instance on all cores, serving clients directly (the baseline)")
def collocated(options: UpOptions) -> Deployment:
    """One vLLM instance on all cores, serving the client directly."""
    return Deployment((plain_instance(options, "vllm", options.port, options.cores),))


@register("round-robin", "two plain vLLM instances, one pinned per core, behind vllm-router round_robin")
def round_robin(options: UpOptions) -> Deployment:
    """Two plain vLLM instances, one per core, behind vllm-router's round_robin policy."""
    if len(options.cores) < 2:
        raise ConfigError("round-robin needs two cores")
    instances = tuple(plain_instance(options, f"vllm{i}", options.port + 1 + i, (core,))
                      for i, core in enumerate(options.cores[:2]))
    router = RouterSpec(port=options.port, prometheus_port=options.port + 3, policy="round_robin",
                        worker_urls=tuple(i.url for i in instances))
    return Deployment(instances, router)
