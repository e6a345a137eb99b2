"""`pdserve instance` and `pdserve router`: the per-host commands (see per_host.py).

Each runs its one process in the foreground; SIGTERM or Ctrl-C stops it (SIGTERM, then SIGKILL
after a deadline) and removes its scratch directory. `--print` shows the command instead.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import signal
import subprocess
from pathlib import Path

from pdserve.config import TRANSPORTS
from pdserve.launch.env import prepare
from pdserve.launch.per_host import Endpoint, InstanceOptions, RouterOptions, instance_command, router_command

STOP_DEADLINE_S = 30.0


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    inst = subparsers.add_parser("instance", help="run one prefill or decode instance of a multi-host PD deployment")
    inst.add_argument("--role", required=True, choices=("prefill", "decode"))
    inst.add_argument("--router", required=True, metavar="IP:PORT", help="the router's discovery address")
    inst.add_argument("--host-ip", required=True, help="this host's address that peers and the router reach")
    inst.add_argument("--model", required=True, help="model directory")
    inst.add_argument("--secret-file", required=True, type=Path, help="the deployment's shared control-plane key")
    inst.add_argument("--mode", default="write", choices=("write", "read"))
    inst.add_argument("--port", type=int, default=8100, help="HTTP port (handshake port+1, notify port+2)")
    inst.add_argument("--handshake-port", type=int)
    inst.add_argument("--notify-port", type=int)
    inst.add_argument("--transport", default="auto", choices=TRANSPORTS)
    inst.add_argument("--allowed-peers", default="", help="comma-separated networks/hosts (default: this host, router)")
    inst.add_argument("--cores", default="", help="CPU list to pin to, e.g. 0 or 0-3")
    inst.add_argument("--connector-extra", default="{}", help="more kv_connector_extra_config keys, as JSON")
    inst.add_argument("--print", action="store_true", help="print the command instead of running it")
    inst.add_argument("vllm_args", nargs=argparse.REMAINDER, help="after --: more `vllm serve` arguments")
    inst.set_defaults(func=run_instance)
    router = subparsers.add_parser("router", help="run vllm-router for a multi-host PD deployment (discovery)")
    router.add_argument("--host-ip", required=True, help="the address clients and instances reach")
    router.add_argument("--port", type=int, default=8000, help="client port (Prometheus port+1, discovery port+2)")
    router.add_argument("--prometheus-port", type=int)
    router.add_argument("--discovery-port", type=int)
    router.add_argument("--print", action="store_true", help="print the command instead of running it")
    router.set_defaults(func=run_router)


def run_instance(args) -> int:
    import json

    options = InstanceOptions(
        role=args.role, router=Endpoint.parse(args.router, "--router"), host_ip=args.host_ip, model=args.model,
        secret_file=args.secret_file, mode=args.mode, port=args.port, handshake_port=args.handshake_port,
        notify_port=args.notify_port, transport=args.transport,
        allowed_peers=tuple(p.strip() for p in args.allowed_peers.split(",") if p.strip()),
        cores=_cores(args.cores), connector_extra=tuple(json.loads(args.connector_extra).items()),
        vllm_args=tuple(a for a in args.vllm_args if a != "--"),
    )
    argv, env = instance_command(options)
    if args.print:
        print(shlex.join(argv))
        return 0
    prepare(env)
    try:
        return _foreground(argv, {**os.environ, **env})
    finally:
        shutil.rmtree(env["VLLM_RPC_BASE_PATH"], ignore_errors=True)


def run_router(args) -> int:
    argv = router_command(RouterOptions(args.host_ip, args.port, args.prometheus_port, args.discovery_port))
    if args.print:
        print(shlex.join(argv))
        return 0
    return _foreground(argv, dict(os.environ))


def _cores(text: str) -> tuple[int, ...]:
    cores: list[int] = []
    for part in filter(None, text.split(",")):
        low, _, high = part.partition("-")
        cores.extend(range(int(low), int(high or low) + 1))
    return tuple(cores)


def _foreground(argv: list[str], env: dict[str, str]) -> int:
    """Run `argv` in its own process group until it exits or we are told to stop."""
    child = subprocess.Popen(argv, env=env, start_new_session=True)
    stopping = []

    def stop(signum, frame):
        stopping.append(signum)
        _signal_group(child, signal.SIGTERM)

    previous = {s: signal.signal(s, stop) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        while True:
            try:
                code = child.wait(timeout=STOP_DEADLINE_S if stopping else None)
                break
            except subprocess.TimeoutExpired:
                _signal_group(child, signal.SIGKILL)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        if child.poll() is None:
            _signal_group(child, signal.SIGKILL)
            child.wait(STOP_DEADLINE_S)
        _signal_group(child, signal.SIGKILL)  # whatever of its group is left
    return 0 if stopping else code


def _signal_group(child: subprocess.Popen, signum: int) -> None:
    try:
        os.killpg(child.pid, signum)
    except ProcessLookupError:
        pass
