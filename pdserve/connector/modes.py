"""`pdserve up --mode write|read`: P and D with PDConnector behind vllm-router (MoRIIO protocol).

Ports, from the deployment's base port B: router B (under `pdserve up`, pdserve's front takes B and
the router moves to B+9), P's HTTP B+1, D's HTTP B+2, router Prometheus B+3,
router discovery B+4, P's handshake/notify B+5/B+6, D's handshake/notify B+7/B+8. P runs on the
first core and D on the second. Both share a control-plane secret kept in the project cache.
This module must not import vLLM: the launcher plans deployments in a plain process.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from pdserve.control.secret import generate_secret_file
from pdserve.errors import ConfigError
from pdserve.launch.env import cache_dir
from pdserve.launch.modes import Deployment, plain_instance, register
from pdserve.launch.options import UpOptions
from pdserve.launch.router import RouterSpec

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


def pd_deployment(options: UpOptions, mode: str, connector_extra: dict | None = None,
                  by_name: bool = False) -> Deployment:
    """The P+D deployment; `connector_extra` goes into both instances' kv_connector_extra_config."""
    if len(options.cores) < 2:
        raise ConfigError(f"{mode} mode needs two cores (P and D each get one)")
    base = options.port
    discovery = base + 4
    instances = []
    for i, (name, role) in enumerate((("prefill", "kv_producer"), ("decode", "kv_consumer"))):
        http_port = base + 1 + i
        spec = plain_instance(options, name, http_port, (options.cores[i],), role=name)
        config = transfer_config(role, mode, http_port, base + 5 + 2 * i, base + 6 + 2 * i, discovery, connector_extra, by_name)
        instances.append(dataclasses.replace(spec, extra_args=("--kv-transfer-config", config)))
    router = RouterSpec(
        port=base, prometheus_port=base + 3, policy="round_robin",
        extra_args=("--vllm-pd-disaggregation", "--kv-connector", "moriio",
                    "--vllm-discovery-address", f"{HOST}:{discovery}"),
    )
    return Deployment(tuple(instances), router, extra_ports=(discovery, *range(base + 5, base + 9)))


@register("write")
def write(options: UpOptions) -> Deployment:
    """PD, WRITE mode: P pushes each layer's KV into D's blocks as it is computed."""
    return pd_deployment(options, "write")


@register("read")
def read(options: UpOptions) -> Deployment:
    """PD, READ mode: P prefills and holds the blocks, D pulls them."""
    return pd_deployment(options, "read")
