"""`python -m pdserve.launch.front`: the front process `pdserve up` runs on the client port.

SIGTERM or SIGINT starts the drain; the process exits 0 once it is over (see server.py).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys

from pdserve.launch.front.config import FrontConfig, Upstream
from pdserve.launch.front.server import FrontServer

logger = logging.getLogger("pdserve.launch.front")


def parse_args(argv: list[str] | None = None) -> FrontConfig:
    p = argparse.ArgumentParser(prog="python -m pdserve.launch.front", description=__doc__.split("\n", 1)[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--upstream", required=True, metavar="NAME=URL", help="where requests go, e.g. router=http://...")
    p.add_argument("--models-from", action="append", required=True, metavar="NAME=URL",
                   help="an instance asked for GET /v1/models (repeat; asked in order)")
    p.add_argument("--drain-timeout", type=float, default=30.0)
    p.add_argument("--idle-timeout", type=float, default=600.0)
    args = p.parse_args(argv)
    return FrontConfig(args.host, args.port, _upstream(args.upstream), tuple(map(_upstream, args.models_from)),
                       args.drain_timeout, args.idle_timeout)


def _upstream(text: str) -> Upstream:
    name, _, url = text.partition("=")
    return Upstream.parse(name, url)


async def serve(config: FrontConfig) -> None:
    server = FrontServer(config)
    await server.start()
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)
    logger.info("front: %s:%d -> %s %s", config.host, config.port, config.upstream.name, config.upstream.url)
    await stopping.wait()
    logger.info("front: draining, %d in flight (up to %.0f s)", server.num_in_flight, config.drain_timeout)
    num_cut_off = await server.drain()
    if num_cut_off:
        logger.warning("front: %d in flight cut off at the drain deadline", num_cut_off)
    logger.info("front: stopped")


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    asyncio.run(serve(parse_args(argv)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
