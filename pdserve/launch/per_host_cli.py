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
import sys

from pdserve.config import TRANSPORTS
from pdserve.control.secret import SECRET_FILE_ENV
from pdserve.errors import ConfigError
from pdserve.launch import arguments as arg
from pdserve.launch.cores import sharing_warning
from pdserve.launch.env import prepare
from pdserve.launch.per_host import Endpoint, InstanceOptions, RouterOptions, instance_command, router_command

STOP_DEADLINE_S = 30.0


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    inst = subparsers.add_parser("instance", help="run one prefill or decode instance of a multi-host PD deployment")
    inst.add_argument("--role", required=True, choices=("prefill", "decode"), help="what this instance does")
    inst.add_argument("--router", required=True, type=arg.host_and_port, metavar="HOST:PORT",
                      help="the router's discovery address (HOST an IP address or a DNS name)")
    inst.add_argument("--host-ip", required=True, type=arg.ip_address, metavar="IP",
                      help="this host's address that peers and the router reach")
    inst.add_argument("--model", required=True, type=arg.model_location,
                      help="a model directory, or a Hugging Face id (org/name) that vLLM resolves")
    inst.add_argument("--secret-file", required=True, type=arg.secret_file, metavar="FILE",
                      help="the deployment's shared control-plane key (a non-empty file, mode 600)")
    inst.add_argument("--mode", default="write", choices=("write", "read"), help="how KV moves: P writes or D reads")
    inst.add_argument("--port", type=arg.port, default=8100,
                      help="HTTP port (handshake ports port+1..port+T, notify ports port+T+1..port+2T for --tp T)")
    inst.add_argument("--handshake-port", type=arg.port, metavar="PORT",
                      help="the first handshake port, rank r binding it + r (default: --port + 1)")
    inst.add_argument("--notify-port", type=arg.port, metavar="PORT",
                      help="the first notify port, rank r binding it + r (default: --port + --tp + 1)")
    inst.add_argument("--tp", type=arg.tensor_parallel_size, default=1, metavar="T",
                      help="tensor-parallel size: T ranks, each with its own handshake and notify port and, with "
                           "--cores, its share of those cores (shared round-robin, with a warning, if fewer than T)")
    inst.add_argument("--transport", default="auto", choices=TRANSPORTS,
                      help="how KV moves: shm on one host, nixl across hosts, auto picks per peer")
    inst.add_argument("--allowed-peers", type=arg.peer_list, metavar="NETS",
                      help="comma-separated networks/hosts that may reach this instance (default: this host, router)")
    inst.add_argument("--cores", type=arg.cpu_list, default="", metavar="CPUS",
                      help="CPU list to pin to, e.g. 0 or 0-3, divided among the --tp ranks (default: no pinning: "
                           "vLLM binds rank r to NUMA node r, so with --tp > 1 it needs as many NUMA nodes)")
    inst.add_argument("--connector-extra", type=arg.json_object, default="{}", metavar="JSON",
                      help="more kv_connector_extra_config keys, as a JSON object")
    inst.add_argument("--print", action="store_true", help="print the command instead of running it")
    inst.add_argument("vllm_args", nargs=argparse.REMAINDER, metavar="-- VLLM_FLAGS",
                      help="after --: more `vllm serve` arguments")
    inst.set_defaults(func=run_instance)
    router = subparsers.add_parser("router", help="run vllm-router for a multi-host PD deployment (discovery)")
    router.add_argument("--host-ip", required=True, type=arg.ip_address, metavar="IP",
                        help="the address clients and instances reach")
    router.add_argument("--port", type=arg.port, default=8000, help="client port (Prometheus port+1, discovery port+2)")
    router.add_argument("--prometheus-port", type=arg.port, metavar="PORT", help="default: --port + 1")
    router.add_argument("--discovery-port", type=arg.port, metavar="PORT", help="default: --port + 2")
    router.add_argument("--secret-file", type=arg.secret_file, default=os.environ.get(SECRET_FILE_ENV), metavar="FILE",
                        help=f"the deployment's shared control-plane key, which registrations must be signed with "
                             f"(default: ${SECRET_FILE_ENV})")
    router.add_argument("--print", action="store_true", help="print the command instead of running it")
    router.set_defaults(func=run_router)


def run_instance(args) -> int:
    if args.vllm_args and args.vllm_args[0] != "--":
        raise ConfigError(f"unrecognized argument {args.vllm_args[0]!r} (vLLM's own flags go after --)")
    options = InstanceOptions(
        role=args.role, router=Endpoint(*args.router), host_ip=args.host_ip, model=args.model,
        secret_file=args.secret_file, mode=args.mode, port=args.port, handshake_port=args.handshake_port,
        notify_port=args.notify_port, transport=args.transport, allowed_peers=args.allowed_peers or (),
        cores=args.cores, connector_extra=tuple(args.connector_extra.items()), vllm_args=tuple(args.vllm_args[1:]),
        tp=args.tp,
    )
    argv, env = instance_command(options)
    if args.cores and len(args.cores) < args.tp:
        print(f"pdserve instance: warning: {sharing_warning({args.role: (args.cores, args.tp)}, len(args.cores))}",
              file=sys.stderr)
    if args.print:
        print(shlex.join(argv))
        return 0
    prepare(env)
    try:
        return _foreground(argv, {**os.environ, **env})
    finally:
        shutil.rmtree(env["VLLM_RPC_BASE_PATH"], ignore_errors=True)


def run_router(args) -> int:
    if args.secret_file is None:
        raise ConfigError(f"--secret-file: the deployment's secret, which registrations are checked against "
                          f"(got none, and ${SECRET_FILE_ENV} is not set)")
    _check_ports("--port", args.port, args.prometheus_port, args.discovery_port)
    argv = router_command(RouterOptions(args.host_ip, args.port, args.prometheus_port, args.discovery_port,
                                        secret_file=args.secret_file))
    if args.print:
        print(shlex.join(argv))
        return 0
    return _foreground(argv, dict(os.environ))


def _check_ports(flag: str, port: int, *given: int | None) -> None:
    """`port` + 1 and + 2 are the defaults of the two others: they must be ports too."""
    if any(p is None for p in given) and port > 65533:
        raise ConfigError(f"{flag}: at most 65533, the next two ports being the defaults of the others (got {port})")


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
