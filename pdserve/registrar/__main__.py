"""`python -m pdserve.registrar --listen HOST:PORT --router-port N --secret-file F -- ROUTER...`

Runs vllm-router (the command after `--`, whose discovery socket binds 127.0.0.1:N) as its child
and the registrar in front of it, so a launcher starts, supervises and stops the two as one process
group. Lifecycle: check the arguments and the secret (exit 2, one line), bind the registrar (exit
1 if it cannot), start the router, serve until the router exits (exit with its code, 128 + the
signal number if a signal ended it) or SIGTERM / SIGINT arrives; then SIGTERM the router, SIGKILL
it after STOP_DEADLINE_S, close the registrar, log the counts and exit 0. The router gets SIGTERM
should this process die first.
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import signal
import subprocess
import sys
import threading
from pathlib import Path

from pdserve.control.secret import load_secret
from pdserve.errors import ConfigError
from pdserve.lifecycle import die_with_parent
from pdserve.registrar.forwarder import Registrar

logger = logging.getLogger("pdserve.registrar")

STOP_DEADLINE_S = 10.0
POLL_S = 0.2


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m pdserve.registrar", description=__doc__.splitlines()[0])
    parser.add_argument("--listen", required=True, metavar="HOST:PORT", help="where instances register")
    parser.add_argument("--router-port", required=True, type=int, help="the router's discovery port on 127.0.0.1")
    parser.add_argument("--secret-file", type=Path, help="the deployment's secret (default: $PDSERVE_SECRET_FILE)")
    parser.add_argument("router", nargs=argparse.REMAINDER, help="after --: the vllm-router command")
    args = parser.parse_args(argv)
    args.router = args.router[1:] if args.router[:1] == ["--"] else args.router
    return args


def listen_address(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    host = host.strip("[]")
    try:
        ipaddress.ip_address(host)
        number = int(port)
    except ValueError:
        number = 0
    if not sep or not 0 < number < 65536:
        raise ConfigError(f"--listen must be IP:PORT, got {text!r}")
    return host, number


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        host, port = listen_address(args.listen)
        if not 0 < args.router_port < 65536:
            raise ConfigError(f"--router-port must be 1..65535, got {args.router_port}")
        if not args.router:
            raise ConfigError("the vllm-router command is missing (after --)")
        secret = load_secret(args.secret_file)
    except ConfigError as e:
        print(f"pdserve registrar: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    stopping = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stopping.set())
    try:
        registrar = Registrar(host, port, args.router_port, secret)
    except ConfigError as e:
        print(f"pdserve registrar: {e}", file=sys.stderr)
        return 1
    try:
        return _serve(registrar, args.router, stopping)
    finally:
        registrar.close()
        logger.info("registrar stopped: %d registrations forwarded, %d frames rejected, %d ignored, %d undeliverable",
                    registrar.num_forwarded, registrar.num_rejected, registrar.num_ignored, registrar.num_undeliverable)


def _serve(registrar: Registrar, router_argv: list[str], stopping: threading.Event) -> int:
    try:
        router = subprocess.Popen(router_argv, stdin=subprocess.DEVNULL, preexec_fn=die_with_parent)
    except OSError as e:
        print(f"pdserve registrar: cannot start the router ({router_argv[0]}): {e}", file=sys.stderr)
        return 1
    logger.info("registrar listening on port %d in front of %s (pid %d)", registrar.port, router_argv[0], router.pid)
    try:
        while not stopping.wait(POLL_S):
            code = router.poll()
            if code is not None:
                logger.error("the router exited with code %d", code)
                return code if code >= 0 else 128 - code
        return 0
    finally:
        _stop(router)


def _stop(router: subprocess.Popen) -> None:
    if router.poll() is None:
        router.terminate()
    try:
        router.wait(STOP_DEADLINE_S)
    except subprocess.TimeoutExpired:
        router.kill()
        router.wait(STOP_DEADLINE_S)


if __name__ == "__main__":
    raise SystemExit(main())
