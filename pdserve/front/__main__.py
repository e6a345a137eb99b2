"""`python -m pdserve.front`: the front process `pdserve up` runs on the client port.

SIGTERM or SIGINT starts the drain; the process exits 0 once it is over (see server.py).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import resource
import signal
import sys

from pdserve.errors import ConfigError
from pdserve.front.config import FrontConfig, Limits, Upstream, limit_flag
from pdserve.front.server import FrontServer

logger = logging.getLogger("pdserve.front")
FILES_PER_CONNECTION = 3  # a client connection served, one waiting, one to the upstream
SPARE_FILES = 64


def parse_args(argv: list[str] | None = None) -> FrontConfig:
    p = argparse.ArgumentParser(prog="python -m pdserve.front", description=__doc__.split("\n", 1)[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--upstream", required=True, metavar="NAME=URL", help="where requests go, e.g. router=http://...")
    p.add_argument("--models-from", action="append", required=True, metavar="NAME=URL",
                   help="an instance asked for GET /v1/models (repeat; asked in order)")
    p.add_argument("--direct-to", action="append", default=[], metavar="NAME=URL",
                   help="an instance that answers a whole request alone, for those a PD router merges wrong (repeat)")
    p.add_argument("--fallback-to", action="append", default=[], metavar="NAME=URL",
                   help="an instance behind a PD router that serves whole requests while another is down or the "
                        "router failed (repeat; preferred in order)")
    p.add_argument("--drain-timeout", type=float, default=30.0)
    for field in dataclasses.fields(Limits):
        p.add_argument(limit_flag(field.name), type=type(field.default), default=field.default)
    args = p.parse_args(argv)
    try:
        limits = Limits(**{field.name: getattr(args, field.name) for field in dataclasses.fields(Limits)})
        return FrontConfig(args.host, args.port, _upstream(args.upstream), tuple(map(_upstream, args.models_from)),
                           tuple(map(_upstream, args.direct_to)), args.drain_timeout, limits,
                           tuple(map(_upstream, args.fallback_to)))
    except ConfigError as exc:
        p.error(str(exc))


def _upstream(text: str) -> Upstream:
    name, _, url = text.partition("=")
    return Upstream.parse(name, url)


def raise_file_limit(max_connections: int) -> None:
    """Let the process open the files its connection limit needs (up to the hard limit); refuse if it cannot."""
    needed = FILES_PER_CONNECTION * max_connections + SPARE_FILES
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft >= needed:
        return
    if hard != resource.RLIM_INFINITY and hard < needed:
        raise ConfigError(f"{limit_flag('max_connections')} {max_connections} needs {needed} open files; this "
                          f"process may open {hard} (ulimit -Hn): lower it")
    resource.setrlimit(resource.RLIMIT_NOFILE, (needed, hard))


async def serve(config: FrontConfig) -> None:
    server = FrontServer(config)
    await server.start()
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)
    logger.info("front: %s:%d -> %s %s", config.host, config.port, config.upstream.name, config.upstream.url)
    if config.fallback_sources:
        logger.info("front: while one is down, or the %s fails, serves whole requests on %s", config.upstream.name,
                    ", ".join(source.name for source in config.fallback_sources))
    await stopping.wait()
    logger.info("front: draining, %d in flight (up to %.0f s)", server.num_in_flight, config.drain_timeout)
    num_cut_off = await server.drain()
    if num_cut_off:
        logger.warning("front: %d in flight cut off at the drain deadline", num_cut_off)
    logger.info("front: stopped")


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    config = parse_args(argv)
    try:
        raise_file_limit(config.limits.max_connections)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        asyncio.run(serve(config))
    except OSError as exc:
        print(f"error: the front cannot listen on {config.host}:{config.port}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
