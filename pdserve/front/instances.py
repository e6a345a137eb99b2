"""The instances of a PD deployment as the front sees them: each up or down, probed all the time.

    pool = InstancePool(config.fallback_sources, metrics)
    pool.start(session)            # Exchange.open(): probes GET /health of each, every 0.5 s
    pool.all_up                    # False: the router would send some requests to a dead instance
    pool.pick()                    # a live instance, in turn (None if none is live)
    pool.mark_down(upstream, why)  # a refused or reset connection seen while forwarding
    await pool.refresh()           # probe every instance now, return once that round is over
    await pool.stop()              # Exchange.close()

Every instance starts up; a probe answered 200 sets it up, another answer or a refused or reset
connection down (a killed instance's port refuses at once). A probe that times out is not a death
by itself (a loaded instance may answer late): only TIMEOUTS_TO_DOWN in a row set it down. Each
change is logged and shown in the gauge pdserve:instance_up.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging

import aiohttp

from pdserve.front.config import Upstream
from pdserve.front.metrics import INSTANCE_UP, FrontMetrics

logger = logging.getLogger(__name__)

PROBE_INTERVAL_S = 0.5
PROBE_TIMEOUT_S = 2.0
TIMEOUTS_TO_DOWN = 3  # probes in a row without an answer before a live instance counts as down
HEALTH_PATH = "/health"


class Health(enum.Enum):
    UP = 1
    DOWN = 0


class InstancePool:
    """`sources`: every instance, in the order the front prefers them (decode first); none where the
    front has no instance to fall back on (then it is never started and always all up)."""

    def __init__(self, sources: tuple[Upstream, ...], metrics: FrontMetrics) -> None:
        self.sources = sources
        self._metrics = metrics
        self._health = dict.fromkeys(sources, Health.UP)
        self._silent = dict.fromkeys(sources, 0)  # probes in a row that timed out
        self._turn = 0
        self._task: asyncio.Task | None = None  # the probing loop, from start() to stop()
        self._wake = asyncio.Event()
        self._next_round: asyncio.Future[None] | None = None  # done at the end of the next round to start
        for source in sources:
            metrics.set(INSTANCE_UP, Health.UP.value, instance=source.name)

    @property
    def all_up(self) -> bool:
        return all(health is Health.UP for health in self._health.values())

    def down(self) -> list[Upstream]:
        return [source for source, health in self._health.items() if health is Health.DOWN]

    def pick(self, exclude: Upstream | None = None) -> Upstream | None:
        """A live instance other than `exclude`, the live ones taken in turn in preference order."""
        live = [source for source, health in self._health.items() if health is Health.UP and source != exclude]
        if not live:
            return None
        self._turn += 1
        return live[(self._turn - 1) % len(live)]

    def mark_down(self, upstream: Upstream, why: str) -> None:
        """`upstream` refused or reset a connection (ignored if it is not one of the instances)."""
        if upstream in self._health:
            self._set(upstream, Health.DOWN, why)

    def start(self, session: aiohttp.ClientSession) -> None:
        if self.sources:
            self._next_round = asyncio.get_running_loop().create_future()
            self._task = asyncio.create_task(self._probe_forever(session), name="front-instance-probes")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def refresh(self) -> None:
        """Probe every instance at once (a request just failed: one may have died); return when done.
        A caller cancelled while it waits leaves the round running."""
        if self._task is None or self._task.done() or self._next_round is None:
            return
        round_over = self._next_round
        self._wake.set()
        await asyncio.shield(round_over)

    async def _probe_forever(self, session: aiohttp.ClientSession) -> None:
        loop = asyncio.get_running_loop()
        this_round = None
        try:
            while True:
                self._wake.clear()
                assert self._next_round is not None
                this_round, self._next_round = self._next_round, loop.create_future()
                await asyncio.gather(*(self._probe(session, source) for source in self.sources))
                this_round.set_result(None)
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(PROBE_INTERVAL_S):
                        await self._wake.wait()
        finally:  # no refresh() waits for a round that will not come
            for waiter in (this_round, self._next_round):
                if waiter is not None and not waiter.done():
                    waiter.set_result(None)

    async def _probe(self, session: aiohttp.ClientSession, source: Upstream) -> None:
        try:
            async with session.get(f"{source.url}{HEALTH_PATH}",
                                   timeout=aiohttp.ClientTimeout(total=PROBE_TIMEOUT_S)) as answer:
                status = answer.status
        except TimeoutError:
            self._silent[source] += 1
            if self._silent[source] >= TIMEOUTS_TO_DOWN:
                self._set(source, Health.DOWN, f"{self._silent[source]} probes in a row unanswered in "
                                               f"{PROBE_TIMEOUT_S:g} s")
            return
        except aiohttp.ClientError as exc:
            self._silent[source] = 0
            self._set(source, Health.DOWN, f"GET {HEALTH_PATH} failed: {exc}")
            return
        self._silent[source] = 0
        self._set(source, Health.UP if status == 200 else Health.DOWN, f"GET {HEALTH_PATH} answered {status}")

    def _set(self, source: Upstream, health: Health, why: str) -> None:
        if self._health[source] is health:
            return
        self._health[source] = health
        self._metrics.set(INSTANCE_UP, health.value, instance=source.name)
        if health is Health.DOWN:
            logger.warning("front: the %s at %s is down (%s): requests go around it", source.name, source.url, why)
        else:
            logger.info("front: the %s at %s is up", source.name, source.url)
