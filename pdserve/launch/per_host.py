"""What one machine of a multi-host PD deployment runs: `pdserve instance` and `pdserve router`.

    host A (10.0.0.1):  pdserve router --host-ip 10.0.0.1
                        pdserve instance --role prefill --router 10.0.0.1:8002 --host-ip 10.0.0.1 --model DIR
    host B (10.0.0.2):  pdserve instance --role decode  --router 10.0.0.1:8002 --host-ip 10.0.0.2 --model DIR

The router is vllm-router in PD mode with discovery, so it needs no list of URLs: instances
register at the discovery address (`--router`), where pdserve's registrar takes only registrations
signed with the deployment's secret and forwards them to the router's own discovery socket on
127.0.0.1, the discovery port + 1 (registrar/). Each instance is one `vllm serve` with
PDConnector whose HTTP, handshake and notify ports bind `--host-ip`; peers in `--allowed-peers`
may reach them. With `--tp T` its rank r binds the handshake and notify ports + r: by default
handshake port+1 .. port+T, notify port+T+1 .. port+2T. Every process of the deployment, the router included, must read the same
`--secret-file` (the control plane's shared key).
The transport defaults to `auto`: shared memory between instances that prove they share a host,
NIXL across hosts. These builders return argv and environment; the CLI execs them in the foreground.
"""

from __future__ import annotations

import ipaddress
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from pdserve.control.secret import SECRET_FILE_ENV
from pdserve.errors import ConfigError
from pdserve.launch.arguments import is_hub_id
from pdserve.launch.cores import omp_threads_bind
from pdserve.launch.env import private_dir, runs_dir, vllm_env
from pdserve.launch.options import check_tp, refuse_tp_flag
from pdserve.launch.router import router_binary
from pdserve.launch.shm_namespace import confine
from pdserve.registrar import RegistrarSpec

ROLES = {"prefill": "kv_producer", "decode": "kv_consumer"}


@dataclass(frozen=True)
class Endpoint:
    host: str
    port: int

    @classmethod
    def parse(cls, text: str, what: str) -> Endpoint:
        host, sep, port = text.rpartition(":")
        try:
            ipaddress.ip_address(host)
            number = int(port)
        except ValueError:
            raise ConfigError(f"{what} must be IP:PORT, got {text!r}") from None
        if not sep or not 0 < number < 65536:
            raise ConfigError(f"{what} must be IP:PORT, got {text!r}")
        return cls(host, number)

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"


@dataclass(frozen=True)
class InstanceOptions:
    role: str  # prefill | decode
    router: Endpoint  # the router's discovery address
    host_ip: str
    model: str
    secret_file: Path
    mode: str = "write"  # write | read
    port: int = 8100  # HTTP; the handshake and notify ports follow it unless given (see handshake, notify)
    handshake_port: int | None = None
    notify_port: int | None = None
    transport: str = "auto"
    allowed_peers: tuple[str, ...] = ()  # default: this host and the router's
    cores: tuple[int, ...] = ()  # divided among the ranks (cores.omp_threads_bind); () leaves binding to vLLM
    connector_extra: tuple[tuple[str, object], ...] = ()  # more kv_connector_extra_config keys
    vllm_args: tuple[str, ...] = ()
    tp: int = 1  # tensor-parallel size: rank r binds handshake + r and notify + r

    @property
    def handshake(self) -> int:
        """The first handshake port: --handshake-port, else port+1 (ranks up to port+tp)."""
        return self.handshake_port or self.port + 1

    @property
    def notify(self) -> int:
        """The first notify port: --notify-port, else port+tp+1 (ranks up to port+2*tp)."""
        return self.notify_port or self.port + self.tp + 1

    def __post_init__(self):
        if self.role not in ROLES:
            raise ConfigError(f"--role must be prefill or decode, got {self.role!r}")
        if self.mode not in ("write", "read"):
            raise ConfigError(f"--mode must be write or read, got {self.mode!r}")
        try:
            ipaddress.ip_address(self.host_ip)
        except ValueError:
            raise ConfigError(f"--host-ip must be an IP address of this host, got {self.host_ip!r}") from None
        if not self.secret_file.is_file():
            raise ConfigError(f"--secret-file {self.secret_file} does not exist (copy the deployment's secret here)")
        check_tp("--tp", self.tp)
        refuse_tp_flag(self.vllm_args, "--tp")
        self._check_ports()

    def _check_ports(self) -> None:
        """The HTTP port and the handshake and notify ranges (a port per rank) lie below 65536, apart."""
        if self.handshake_port is None or self.notify_port is None:
            after = 2 * self.tp if self.notify_port is None else self.tp  # the default ports after --port
            if self.port + after > 65535:
                raise ConfigError(f"--port: at most {65535 - after}: the {after} ports after it are the default "
                                  f"handshake and notify ports, one each per rank of --tp {self.tp} (got {self.port})")
        given = [("--handshake-port", "handshake", self.handshake_port), ("--notify-port", "notify", self.notify_port)]
        for flag, _, first in given:
            if first is not None and first + self.tp - 1 > 65535:
                raise ConfigError(f"{flag}: at most {65536 - self.tp}, rank r of --tp {self.tp} binding it + r "
                                  f"(got {first})")
        ranges = {"HTTP": range(self.port, self.port + 1), "handshake": range(self.handshake, self.handshake + self.tp),
                  "notify": range(self.notify, self.notify + self.tp)}
        for flag, name, first in given:
            for other, ports in ranges.items():
                if first is not None and other != name and set(ranges[name]) & set(ports):
                    raise ConfigError(f"{flag}: ports {_span(ranges[name])} (one per rank of --tp {self.tp}) overlap "
                                      f"the {other} port{'s' * (len(ports) > 1)} {_span(ports)}; give ports apart "
                                      f"(got {first})")


def _span(ports: range) -> str:
    return str(ports[0]) if len(ports) == 1 else f"{ports[0]}..{ports[-1]}"


def instance_command(o: InstanceOptions) -> tuple[list[str], dict[str, str]]:
    """`vllm serve` with PDConnector for one host (argv, environment to add)."""
    extra = {
        "read_mode": o.mode == "read",
        "host_ip": o.host_ip,
        "http_port": o.port,
        "handshake_port": o.handshake,
        "notify_port": o.notify,
        "proxy_ip": o.router.host,
        "proxy_ping_port": o.router.port,
        "secret_file": str(o.secret_file),
        "transport": o.transport,
        "allowed_peers": list(o.allowed_peers or (o.host_ip, o.router.host)),
        **dict(o.connector_extra),
    }
    config = {"kv_connector": "PDConnector", "kv_connector_module_path": "pdserve.connector",
              "kv_role": ROLES[o.role], "kv_connector_extra_config": extra}
    parallel = ["--tensor-parallel-size", str(o.tp)] if o.tp > 1 else []
    argv = [sys.executable, "-m", "pdserve.vllm_cli", "serve", o.model, "--host", o.host_ip, "--port", str(o.port),
            *parallel, *o.vllm_args, "--kv-transfer-config", json.dumps(config)]
    scratch = private_dir(runs_dir()) / f"{o.role}-{o.host_ip}-{o.port}-{os.getpid()}"
    env = vllm_env(scratch, offline=not is_hub_id(o.model))
    if o.cores:
        argv = ["taskset", "-c", ",".join(map(str, o.cores)), *argv]
        env.update(VLLM_CPU_OMP_THREADS_BIND=omp_threads_bind(o.cores, o.tp), VLLM_CPU_NUM_OF_RESERVED_CPU="0")
    # a private /dev/shm (as under `pdserve up`): what vLLM leaves there goes with the instance;
    # the KV cache lives there too, so the limit is the machine's memory
    return list(confine(tuple(argv), os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")).argv), env


@dataclass(frozen=True)
class RouterOptions:
    host_ip: str
    port: int = 8000  # clients; Prometheus port+1, discovery port+2 unless given
    prometheus_port: int | None = None
    discovery_port: int | None = None
    secret_file: Path | None = None  # the deployment's secret; None: $PDSERVE_SECRET_FILE

    def __post_init__(self):
        path = self.secret_file or os.environ.get(SECRET_FILE_ENV)
        if not path:
            raise ConfigError(f"the router's registrar needs the deployment's secret: set ${SECRET_FILE_ENV}")
        if not Path(path).is_file():
            raise ConfigError(f"secret file {path} does not exist (copy the deployment's secret here)")
        router_discovery = self.discovery.port + 1
        if router_discovery > 65535 or router_discovery in (self.port, self.prometheus_port or self.port + 1):
            raise ConfigError(f"--discovery-port: the router's own discovery socket takes the next port "
                              f"({router_discovery}), which must be free for it (choose another discovery port)")

    @property
    def discovery(self) -> Endpoint:
        """Where instances register: the registrar."""
        return Endpoint(self.host_ip, self.discovery_port or self.port + 2)

    def registrar(self) -> RegistrarSpec:
        secret = Path(self.secret_file or os.environ[SECRET_FILE_ENV])
        return RegistrarSpec(self.host_ip, self.discovery.port, self.discovery.port + 1, secret)


def router_command(o: RouterOptions) -> list[str]:
    """vllm-router in PD mode behind the registrar, instances registering at `o.discovery`."""
    return list(o.registrar().wrap([
        router_binary(), "--host", o.host_ip, "--port", str(o.port), "--prometheus-host", o.host_ip,
        "--prometheus-port", str(o.prometheus_port or o.port + 1), "--policy", "round_robin",
        "--prefill-policy", "round_robin", "--decode-policy", "power_of_two", "--log-level", "warning",
        "--vllm-pd-disaggregation", "--kv-connector", "moriio"]))
