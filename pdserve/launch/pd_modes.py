"""`pdserve up --mode write|read|adaptive|adaptive-read`: P and D with PDConnector behind vllm-router
(MoRIIO protocol).

xPyD: `--prefill N --decode M` (UpOptions.num_prefill / num_decode, 1 and 1 by default) runs N
prefill and M decode instances; every one registers with vllm-router's discovery socket, and the
router picks a prefill and a decode instance per request with a policy per role: prefill
round_robin (request k goes to prefill k mod N), decode power_of_two (of two decode instances
drawn at random, the one with fewer requests in flight, as the router counts them). vllm-router
0.1.17 keeps one counter per policy, so round_robin for both would tie prefill i to decode i
whenever N = M; with power_of_two any prefill pairs with any decode, and the streams spread by
count: a prefill instance that serves whole requests too (placement/serve_gate.py) gets the new
requests until it runs as many as decode does, where a random pick would leave decode's streams
the more loaded.

Tensor parallelism: `--prefill-tp` / `--decode-tp` (UpOptions.prefill_tp / decode_tp, 1 by default)
run each prefill or decode instance with that many ranks; rank r of an instance binds its handshake
and notify ports + r, so an instance of T ranks has T consecutive ports of each.

Ports, from the deployment's base port B, with K = N + M instances and R = N*prefill_tp + M*decode_tp
ranks; instance i (prefill 0..N-1, then decode) has T_i ranks, and S_i = T_0 + ... + T_(i-1):
    B                      router (under `pdserve up`, pdserve's front takes B and the router moves
                           to B+K+2R+4, the first port after all of these)
    B+1 .. B+N             prefill instances' HTTP
    B+N+1 .. B+K           decode instances' HTTP
    B+K+1                  router Prometheus
    B+K+2                  discovery: pdserve's registrar, where instances register (registrar/)
    B+K+3+2S_i ..          instance i's T_i handshake ports, then its T_i notify ports
    B+K+2R+3               the router's own discovery socket, which only the registrar reaches
so 1P+1D is B, P B+1, D B+2, Prometheus B+3, discovery B+4, handshake/notify B+5..B+8, the
router's discovery B+9, router B+10; 2P+1D uses B..B+13; 1P+1D with prefill_tp 2 gives P the
handshake ports B+5, B+6 and notify ports B+7, B+8, D B+9 and B+10. Instances are named
prefill/decode when there is one of the role, else prefill0, prefill1, ... Cores are divided among
the ranks by launch.cores.divide_cores (every rank its own cores where there are enough; shared,
with one warning, where not). All instances and the registrar share a control-plane secret kept in
the project cache.
This module must not import vLLM: the launcher plans deployments in a plain process.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from pdserve.control.secret import generate_secret_file
from pdserve.errors import ConfigError
from pdserve.launch.cores import divide_cores, sharing_warning
from pdserve.launch.env import cache_dir
from pdserve.launch.modes import Deployment, plain_instance, register
from pdserve.launch.options import UpOptions
from pdserve.launch.router import RouterSpec
from pdserve.registrar import RegistrarSpec

HOST = "127.0.0.1"


def secret_file() -> Path:
    path = cache_dir() / "control-secret"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        generate_secret_file(path)
    return path


def transfer_config(role: str, mode: str, http_port: int, handshake_port: int, notify_port: int,
                    discovery_port: int, extra: dict | None = None, by_name: bool = False) -> str:
    """vLLM's --kv-transfer-config for one instance. `by_name` relies on the `pdserve` vLLM plugin
    entry point to register the connector name instead of naming the module."""
    location = {} if by_name else {"kv_connector_module_path": "pdserve.connector"}
    return json.dumps({
        "kv_connector": "PDConnector",
        **location,
        "kv_role": role,
        "kv_connector_extra_config": {
            "read_mode": mode == "read",
            "host_ip": HOST,
            "http_port": http_port,
            "handshake_port": handshake_port,
            "notify_port": notify_port,
            "proxy_ip": HOST,
            "proxy_ping_port": discovery_port,
            "secret_file": str(secret_file()),
            **(extra or {}),
        },
    })


@dataclass(frozen=True)
class PortLayout:
    """The ports of an N-prefill, M-decode deployment from base port `base`, each prefill instance
    of `prefill_tp` ranks and each decode instance of `decode_tp` (module docstring)."""

    base: int
    num_prefill: int
    num_decode: int
    prefill_tp: int = 1
    decode_tp: int = 1

    @property
    def num_instances(self) -> int:
        return self.num_prefill + self.num_decode

    def tp(self, index: int) -> int:
        """The number of ranks of instance `index` (prefill 0..N-1, then decode)."""
        return self.prefill_tp if index < self.num_prefill else self.decode_tp

    def http(self, index: int) -> int:
        """Instance `index` (prefill 0..N-1, then decode)."""
        return self.base + 1 + index

    @property
    def prometheus(self) -> int:
        return self.base + self.num_instances + 1

    @property
    def discovery(self) -> int:
        return self.base + self.num_instances + 2

    def handshake(self, index: int) -> int:
        """The first handshake port of instance `index`; its rank r binds this + r."""
        ranks_before = sum(self.tp(i) for i in range(index))
        return self.base + self.num_instances + 3 + 2 * ranks_before

    def notify(self, index: int) -> int:
        """The first notify port of instance `index`; its rank r binds this + r."""
        return self.handshake(index) + self.tp(index)

    @property
    def router_discovery(self) -> int:
        last = self.num_instances - 1
        return self.notify(last) + self.tp(last)

    @property
    def control_ports(self) -> tuple[int, ...]:
        """Discovery, every rank's handshake and notify port and the router's discovery (the ports
        no HTTP server binds)."""
        instances = (first + rank for i in range(self.num_instances) for first in (self.handshake(i), self.notify(i))
                     for rank in range(self.tp(i)))
        return (self.discovery, *instances, self.router_discovery)

    @property
    def last(self) -> int:
        """The highest port of the layout (the front's move of the router takes the next one)."""
        return self.router_discovery


def instance_names(role: str, count: int) -> list[str]:
    return [role] if count == 1 else [f"{role}{i}" for i in range(count)]


def pd_deployment(options: UpOptions, mode: str, connector_extra: dict | None = None,
                  by_name: bool = False) -> Deployment:
    """The xPyD deployment of `options.num_prefill` P and `options.num_decode` D instances;
    `connector_extra` goes into every instance's kv_connector_extra_config."""
    if options.kv_verify is not None:
        connector_extra = {"kv_verify": options.kv_verify, **(connector_extra or {})}
    ports = PortLayout(options.port, options.num_prefill, options.num_decode, options.prefill_tp, options.decode_tp)
    if ports.last + 1 > 65535:
        raise ConfigError(f"{ports.num_instances} PD instances from port {options.port} need ports up to "
                          f"{ports.last + 1}: choose a lower --port")
    cores = divide_cores(options.cores, options.num_prefill, options.num_decode, options.prefill_tp,
                         options.decode_tp)
    roles = [("prefill", "kv_producer", name, c)
             for name, c in zip(instance_names("prefill", options.num_prefill), cores.prefill)]
    roles += [("decode", "kv_consumer", name, c)
              for name, c in zip(instance_names("decode", options.num_decode), cores.decode)]
    instances = []
    for i, (role, kv_role, name, instance_cores) in enumerate(roles):
        spec = plain_instance(options, name, ports.http(i), instance_cores, role=role)
        config = transfer_config(kv_role, mode, ports.http(i), ports.handshake(i), ports.notify(i), ports.discovery,
                                 connector_extra, by_name)
        instances.append(dataclasses.replace(spec, extra_args=("--kv-transfer-config", config)))
    registrar = RegistrarSpec(HOST, ports.discovery, ports.router_discovery, secret_file())
    router = RouterSpec(
        port=options.port, prometheus_port=ports.prometheus, policy="round_robin",
        extra_args=("--prefill-policy", "round_robin", "--decode-policy", "power_of_two",
                    "--vllm-pd-disaggregation", "--kv-connector", "moriio"),
        registrar=registrar,
    )
    warnings = ()
    if cores.shared:
        warnings = (sharing_warning({i.name: (i.cores, i.tp) for i in instances}, len(options.cores)),)
        # ranks sharing a core must not spin while they wait for each other: OpenMP's default
        # active wait starves the other process on that core for seconds at a time
        instances = [dataclasses.replace(i, extra_env={**i.extra_env, "OMP_WAIT_POLICY": "PASSIVE"})
                     for i in instances]
    return Deployment(tuple(instances), router, extra_ports=ports.control_ports, warnings=warnings)


@register("write")
def write(options: UpOptions) -> Deployment:
    """PD, WRITE mode: P pushes each layer's KV into D's blocks as it is computed."""
    return pd_deployment(options, "write")


@register("read")
def read(options: UpOptions) -> Deployment:
    """PD, READ mode: P prefills and holds the blocks, D pulls them."""
    return pd_deployment(options, "read")


ADAPTIVE_PREFILL_BUDGET = 512  # one 512-token prompt per P step: no prompt waits behind three others
# The most tokens of local prefill D computes in one step: a 512-token prompt in one step while D has
# no stream running. With streams running the connector lowers the limit step by step so that no
# step exceeds max_step_ms (placement/chunk_size.py).
ADAPTIVE_DECODE_BUDGET = 512
# D's step budget is that cap plus this: a local prefill never takes the whole budget, so D's decodes
# always fit and vLLM still looks at new requests (it admits none while the budget is spent), i.e. D
# decides a new request's placement within one step even while it prefills one itself
ADAPTIVE_DECODE_RESERVE = 64


# READ mode, where the prefill instance decides: its budget beyond one prompt's chunk (its
# --long-prefill-token-threshold) is room for the one-token legs of the prompts it left to the decode
# instance, so they ride beside a started prompt's chunk instead of waiting a step (placement/read_mode.py)
ADAPTIVE_PREFILL_RESERVE = 16


@register("adaptive")
def adaptive(options: UpOptions) -> Deployment:
    """PD, WRITE mode with per-request placement: decode prefills a prompt itself (chunked) when that is faster."""
    return _adaptive(options, "write")


@register("adaptive-read")
def adaptive_read(options: UpOptions) -> Deployment:
    """PD, READ mode with per-request placement: prefill leaves a prompt to decode (chunked) when that is faster."""
    return _adaptive(options, "read")


def _adaptive(options: UpOptions, mode: str) -> Deployment:
    chunk = options.decode_budget or ADAPTIVE_DECODE_BUDGET
    prefill = options.prefill_budget or ADAPTIVE_PREFILL_BUDGET
    reserve = ADAPTIVE_PREFILL_RESERVE if mode == "read" else 0
    tuned = dataclasses.replace(options, prefill_budget=prefill + reserve, prefill_chunk=prefill if reserve else None,
                                decode_budget=chunk + ADAPTIVE_DECODE_RESERVE, decode_chunk=chunk)
    extra = {"placement": "adaptive"}
    for key in ("itl_target_ms", "max_step_ms"):
        if getattr(options, key) is not None:
            extra[key] = getattr(options, key)
    if options.slo is not None:
        extra["slo"] = options.slo
    if options.serve_decode:
        extra["serve_decode"] = True
    return pd_deployment(tuned, mode, extra)
