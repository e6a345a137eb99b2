"""`kv_connector_extra_config` parsed once into a frozen `ConnectorConfig`.

Key names follow vLLM's MoRIIO connector where they mean the same (`handshake_port`,
`notify_port`, `read_mode`, `host_ip`, `proxy_ip`, `proxy_ping_port`, `http_port`,
`transfer_timeout`, `defer_timeout`), so a MoRIIO user switches by changing the connector name.
Environment variables are read here and nowhere else in the connector.
"""

from __future__ import annotations

import ipaddress
import os
import re
from dataclasses import dataclass
from enum import Enum
from typing import Any, Mapping

from pdserve.errors import ConfigError
from pdserve.placement.config import PLACEMENT_KEYS, PlacementConfig, parse_placement

SECRET_FILE_ENV = "PDSERVE_SECRET_FILE"
FAULT_PLAN_ENV = "PDSERVE_FAULT_PLAN"  # test-only: path of a fault plan (pdserve/faults)
LOAD_FAILURE_POLICIES = ("recompute", "fail")
TRANSPORTS = ("auto", "shm", "nixl", "gpu-ipc")  # auto: shm (gpu-ipc for KV on a GPU) for a peer proven on this host, NIXL otherwise
KV_VERIFY = ("digest", "off")  # digest: D checks a per-block CRC-32 of what P sent (transfer/kv_digest.py)
KV_BUFFER_DEVICES = ("cpu", "cuda")  # where KV moves from: host memory, or the GPU it lives on
_HOST_NAME = re.compile(r"^(?=.*[A-Za-z])[A-Za-z0-9]([A-Za-z0-9.-]{0,251}[A-Za-z0-9])?$")


class TransferMode(Enum):
    WRITE = "WRITE"  # prefill pushes each layer into decode's blocks
    READ = "READ"  # decode pulls the blocks after prefill finished


class Role(Enum):
    PRODUCER = "P"
    CONSUMER = "D"


@dataclass(frozen=True)
class ConnectorConfig:
    role: Role
    mode: TransferMode
    host_ip: str
    handshake_port: int
    notify_port: int
    http_port: int | None
    proxy_ip: str | None
    proxy_ping_port: int | None
    secret_file: str
    transport: str
    handshake_timeout: float  # seconds to get a peer's handshake reply
    transfer_timeout: float  # D: seconds from block announcement/read start to KV landed
    defer_timeout: float  # P: seconds it holds blocks waiting for D (announce or release)
    release_grace: float  # D: seconds it waits for P to confirm no more writes after giving up
    heartbeat_interval: float
    allowed_peers: tuple[str, ...]  # IP networks (CIDR) or exact host names this instance may contact
    peer_idle_timeout: float  # seconds after which a peer with no transfer is forgotten
    load_failure_policy: str  # "recompute": D prefills a request itself when its KV cannot arrive
    test_corrupt_transfers: bool  # test-only, read by the fault rig (pdserve/faults): flip bytes after every copy
    test_fault_plan: str | None  # test-only, read by the fault rig (pdserve/faults): fault-injection plan file
    placement: PlacementConfig = PlacementConfig()  # per-request placement (pdserve/placement/)
    kv_buffer_device: str = "cpu"  # cpu: KV on a GPU moves through a pinned host mirror; cuda: from the GPU
    kv_device: str = "cpu"  # where vLLM keeps the KV cache (its platform's device type)
    kv_verify: str = "off"  # "digest": every transfer's blocks checked against P's digest (kv_digest.py)

    @property
    def host_staging(self) -> bool:
        """KV on a GPU moved through host memory. With the KV in host memory kv_buffer_device cpu
        is the KV's own device: there is nothing to stage."""
        return self.kv_buffer_device == "cpu" and self.kv_device != "cpu"

    @property
    def engine_id(self) -> str:
        return f"{self.host_ip}:{self.handshake_port}"

    @property
    def zmq_address(self) -> str:
        return f"host:{self.host_ip},handshake:{self.handshake_port},notify:{self.notify_port}"


_KNOWN_KEYS = {
    "handshake_port", "notify_port", "read_mode", "host_ip", "proxy_ip", "proxy_ping_port",
    "http_port", "transfer_timeout", "defer_timeout", "handshake_timeout", "release_grace",
    "heartbeat_interval", "transport", "secret_file", "test_corrupt_transfers", "allowed_peers",
    "peer_idle_timeout", "load_failure_policy", "test_fault_plan", "kv_buffer_device", "kv_verify", *PLACEMENT_KEYS,
}


def _bool(key: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, (int, str)) and str(value).lower() in ("1", "true", "yes", "0", "false", "no"):
        return str(value).lower() in ("1", "true", "yes")
    raise ConfigError(f"kv_connector_extra_config.{key} must be a boolean, got {value!r}")


def _port(key: str, value: Any) -> int:
    if isinstance(value, bool):
        raise ConfigError(f"kv_connector_extra_config.{key} must be a port number, got {value!r}")
    try:
        port = int(value)
    except (TypeError, ValueError):
        raise ConfigError(f"kv_connector_extra_config.{key} must be a port number, got {value!r}") from None
    if not 0 < port < 65536:
        raise ConfigError(f"kv_connector_extra_config.{key} must be in 1..65535, got {port}")
    return port


def _seconds(key: str, value: Any) -> float:
    if isinstance(value, bool):
        raise ConfigError(f"kv_connector_extra_config.{key} must be a number of seconds, got {value!r}")
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"kv_connector_extra_config.{key} must be a number of seconds, got {value!r}") from None
    if not 0 < seconds < float("inf"):
        raise ConfigError(f"kv_connector_extra_config.{key} must be positive and finite, got {seconds}")
    return seconds


def _allowed_peers(value: Any, host_ip: str) -> tuple[str, ...]:
    if value is None:
        return ("127.0.0.0/8", "::1/128", host_ip)
    items = value.split(",") if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)) or not all(isinstance(i, str) and i.strip() for i in items):
        raise ConfigError(f"kv_connector_extra_config.allowed_peers must be a list of networks or hosts, got {value!r}")
    out = tuple(i.strip() for i in items)
    for item in out:
        try:
            ipaddress.ip_network(item, strict=False)
        except ValueError:
            if not _HOST_NAME.match(item):
                raise ConfigError(f"kv_connector_extra_config.allowed_peers: {item!r} is neither an IP network "
                                  "nor a host name") from None
    return out


def parse_connector_config(
    kv_role: str, extra: Mapping[str, Any] | None, env: Mapping[str, str] | None = None,
    vllm_kv_buffer_device: str | None = None, kv_device: str = "cpu",
) -> ConnectorConfig:
    """Build the config from vLLM's `kv_role` and `kv_connector_extra_config`; `vllm_kv_buffer_device`
    is vLLM's own `kv_transfer_config.kv_buffer_device`, `kv_device` the device type vLLM keeps
    the KV cache on."""
    extra = dict(extra or {})
    env = os.environ if env is None else env
    unknown = sorted(set(extra) - _KNOWN_KEYS)
    if unknown:
        raise ConfigError(f"unknown kv_connector_extra_config keys: {', '.join(unknown)}")
    if kv_role == "kv_producer":
        role = Role.PRODUCER
    elif kv_role == "kv_consumer":
        role = Role.CONSUMER
    else:
        raise ConfigError(f"PDConnector needs kv_role kv_producer or kv_consumer, got {kv_role!r}")
    secret_file = extra.get("secret_file") or env.get(SECRET_FILE_ENV)
    if not secret_file:
        raise ConfigError(
            "PDConnector needs a shared secret for its control plane: set "
            f"kv_connector_extra_config.secret_file or {SECRET_FILE_ENV}"
        )
    transport = str(extra.get("transport", "auto"))
    if transport not in TRANSPORTS:
        raise ConfigError(f"unknown transport {transport!r} (available: {', '.join(TRANSPORTS)})")
    kv_buffer_device = _kv_buffer_device(extra, vllm_kv_buffer_device, kv_device)
    _check_transport_reaches_kv(transport, kv_buffer_device, kv_device)
    proxy_ip = extra.get("proxy_ip") or None
    proxy_port = extra.get("proxy_ping_port")
    if bool(proxy_ip) != bool(proxy_port):
        raise ConfigError("proxy_ip and proxy_ping_port must be given together")
    http_port = extra.get("http_port")
    if proxy_ip and not http_port:
        raise ConfigError("http_port is required when registering with a router (proxy_ip)")
    placement = parse_placement(extra)
    if placement.serve_decode and _bool("read_mode", extra.get("read_mode", False)):
        raise ConfigError("serve_decode is a WRITE-mode placement option: in READ mode the prefill "
                          "instance decides each placement itself when the request arrives")
    return ConnectorConfig(
        role=role,
        mode=TransferMode.READ if _bool("read_mode", extra.get("read_mode", False)) else TransferMode.WRITE,
        host_ip=str(extra.get("host_ip", "127.0.0.1")),
        handshake_port=_port("handshake_port", extra.get("handshake_port", 6301)),
        notify_port=_port("notify_port", extra.get("notify_port", 6401)),
        http_port=_port("http_port", http_port) if http_port else None,
        proxy_ip=str(proxy_ip) if proxy_ip else None,
        proxy_ping_port=_port("proxy_ping_port", proxy_port) if proxy_port else None,
        secret_file=str(secret_file),
        transport=transport,
        handshake_timeout=_seconds("handshake_timeout", extra.get("handshake_timeout", 10.0)),
        transfer_timeout=_seconds("transfer_timeout", extra.get("transfer_timeout", 30.0)),
        defer_timeout=_seconds("defer_timeout", extra.get("defer_timeout", 60.0)),
        release_grace=_seconds("release_grace", extra.get("release_grace", 2.0)),
        heartbeat_interval=_seconds("heartbeat_interval", extra.get("heartbeat_interval", 1.0)),
        allowed_peers=_allowed_peers(extra.get("allowed_peers"), str(extra.get("host_ip", "127.0.0.1"))),
        peer_idle_timeout=_seconds("peer_idle_timeout", extra.get("peer_idle_timeout", 300.0)),
        load_failure_policy=_policy(extra.get("load_failure_policy", "recompute")),
        test_corrupt_transfers=_bool("test_corrupt_transfers", extra.get("test_corrupt_transfers", False)),
        test_fault_plan=str(extra.get("test_fault_plan") or env.get(FAULT_PLAN_ENV) or "") or None,
        placement=placement,
        kv_buffer_device=kv_buffer_device,
        kv_device=kv_device,
        kv_verify=_kv_verify(extra.get("kv_verify"), kv_buffer_device, kv_device),
    )


def _policy(value: Any) -> str:
    if value not in LOAD_FAILURE_POLICIES:
        raise ConfigError(f"kv_connector_extra_config.load_failure_policy must be one of "
                          f"{', '.join(LOAD_FAILURE_POLICIES)}, got {value!r}")
    return value


def _kv_verify(value: Any, kv_buffer_device: str, kv_device: str) -> str:
    """`digest` by default where the KV moves from host memory (hashing it costs about 1 % of a
    prompt's TTFT, docs/configuration.md); KV moved straight from GPU memory is not hashed yet, so
    there the default is `off` and `digest` is refused."""
    from_host = kv_device == "cpu" or kv_buffer_device == "cpu"
    if value is None:
        return "digest" if from_host else "off"
    if value not in KV_VERIFY:
        raise ConfigError(f"kv_connector_extra_config.kv_verify must be one of {', '.join(KV_VERIFY)}, got {value!r}")
    if value == "digest" and not from_host:
        raise ConfigError("kv_connector_extra_config.kv_verify digest hashes KV in host memory, but the KV cache is on "
                          f"{kv_device} and kv_buffer_device is cuda: use kv_buffer_device cpu (host staging) or "
                          "kv_verify off")
    return value


def _kv_buffer_device(extra: Mapping[str, Any], vllm_value: str | None, kv_device: str) -> str:
    """pdserve's `kv_buffer_device`; without it vLLM's field of that name (same meaning: `cpu`
    stages a GPU's KV in host memory, as vLLM's NixlConnector does); without both the KV's own
    device."""
    if "kv_buffer_device" in extra:
        value, field = extra["kv_buffer_device"], "kv_connector_extra_config.kv_buffer_device"
    elif vllm_value is not None:
        value, field = vllm_value, "kv_transfer_config.kv_buffer_device (vLLM's, read when pdserve's is absent)"
    else:
        return kv_device
    if value not in KV_BUFFER_DEVICES:
        raise ConfigError(f"{field} must be cpu (KV on a GPU moves through host memory) or cuda (it moves "
                          f"from the GPU), got {value!r}")
    return value


def _check_transport_reaches_kv(transport: str, kv_buffer_device: str, kv_device: str) -> None:
    """ConfigError for a transport that cannot move the KV from where it moves from."""
    from_host = kv_device == "cpu" or kv_buffer_device == "cpu"
    if transport == "gpu-ipc" and from_host:
        where = "the KV cache is in host memory" if kv_device == "cpu" else "kv_buffer_device cpu stages it there"
        raise ConfigError(f"kv_connector_extra_config.transport gpu-ipc moves GPU memory, but {where}: "
                          "use transport auto, shm or nixl")
    if transport == "shm" and not from_host:
        raise ConfigError(f"kv_connector_extra_config.transport shm moves host memory, but the KV cache is on "
                          f"{kv_device} and kv_buffer_device is cuda: use transport gpu-ipc, auto or nixl, or "
                          "kv_buffer_device cpu")
