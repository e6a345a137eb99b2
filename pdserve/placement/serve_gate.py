"""ServeGate: whether a prefill instance with `serve_decode` offers itself to vllm-router as a
decode instance right now.

Serving whole requests on P (connector/scheduler/whole_requests.py) pays where decode is the bottleneck, and only
there: a request P serves whole decodes beside P's prefill steps for D's legs, so while D's
streams have room it costs those streams' neighbours on P, and D's legs P's time. So P registers
as a decode instance only while D's streams are loaded, judged by what D publishes
(`DecodeStatus`, every STATUS_EVERY_S in WRITE mode), against the ITL target of the placement
config: how slowly D's streams advance now (`streams_itl`), the larger of the mean ITL they saw
over the last few seconds (`now_itl_s`) and the decode step D's fitted costs predict for the
streams it runs now (it follows arrivals within a status). Not the mean over a stream's lifetime
(`recent_itl_s`, what placement weighs): it lags D's load by a lifetime (~25 s for 512-token
answers), so a D that idled after a loaded spell would reopen the gate with its first new stream.

* It opens when that ITL reaches OPEN_AT x the target on some decode instance and P has room:
  its queue is at most one step's budget (a P behind on D's legs has no time to give), it spent
  at most MAX_PREFILL_SHARE of the last seconds in prefill steps (`PrefillLoad.prefill_share`),
  and a stream it took now would advance faster than D's do (`p_stream_itl`: D's fitted decode
  step for P's streams and one more, stretched by P's prefill steps). So on decode-heavy traffic,
  where P idles between short prompts, it opens once D's streams near the target; on prefill-heavy
  traffic, where P's time is D's legs', it stays shut. Not sooner: a decode step is mostly fixed
  cost, so streams well within the target gain a few ms on P and take P's chunk steps instead,
  whose gaps cost the max-gap bound more than P's help gains.
* It closes when every decode instance's ITL is below CLOSE_AT x the target (or D says nothing
  for STALE_S: an idle D publishes nothing), or P's prefill share rises past MAX_PREFILL_SHARE,
  but not before it was open MIN_OPEN_S: the router forgets a decode instance only 5-11 s after
  its last heartbeat (a 5 s expiry, swept every ~5 s), so shorter spells would only flap.

The router then sends P a share of the decode legs (pdserve launches it with the decode policy
power_of_two: each new request goes to the decode instance with fewer in flight, so P takes the new
ones until it runs as many as D), and D's streams see fewer neighbours. While P decodes, D places
prompts by balance (balance.py), not by P's idleness. Thread-safe: statuses come in on the
control-plane server threads, P's load on the worker thread, `is_open` is asked by the heartbeat
thread. Free of vLLM.
"""

from __future__ import annotations

import logging
import threading
import time

from pdserve.placement.balance import streams_now_itl, stretched_step
from pdserve.placement.messages import DecodeStatus, PrefillLoad
from pdserve.placement.status_view import costs_of

logger = logging.getLogger("pdserve.connector")

OPEN_AT = 0.75  # x the ITL target: D's streams' ITL now from which P may serve whole requests
CLOSE_AT = 0.5  # x the ITL target: below this on every decode instance, P stops
MAX_PREFILL_SHARE = 0.5  # P spending more of its time in prefill steps keeps it for D's legs
MIN_OPEN_S = 10.0  # an open gate stays open at least this long
STALE_S = 2.0  # a decode instance not heard from for this long counts as idle
STATUS_EVERY_S = 0.5  # D publishes its status to P this often in WRITE mode (the gate's timescale is seconds)


class ServeGate:
    def __init__(self, itl_target_s: float, clock=time.monotonic):
        if not itl_target_s > 0:
            raise ValueError(f"itl_target_s must be positive, got {itl_target_s}")
        self._itl_target_s = itl_target_s
        self._clock = clock
        self._lock = threading.Lock()
        self._heard: dict[tuple[str, int], tuple[float, float | None, DecodeStatus]] = {}  # D -> (received at, ITL, status)
        self._own_load: PrefillLoad | None = None
        self._opened_at: float | None = None
        self.openings = 0

    def on_status(self, status: DecodeStatus) -> None:
        with self._lock:
            self._heard[(status.decode_host, status.decode_handshake_port)] = (self._clock(), streams_itl(status), status)

    def on_own_load(self, load: PrefillLoad) -> None:
        self._own_load = load

    @property
    def open(self) -> bool:
        """The state the last `is_open` left (for metrics)."""
        return self._opened_at is not None

    def is_open(self) -> bool:
        """Decide now; the heartbeat thread asks before each beat."""
        with self._lock:
            now = self._clock()
            fresh = [(itl, status) for at, itl, status in self._heard.values() if now - at < STALE_S and itl is not None]
            loaded, busiest = max(fresh, key=lambda pair: pair[0], default=(0.0, None))
            own = self._own_load
            prefill_bound = own is not None and own.prefill_share > MAX_PREFILL_SHARE
            if self._opened_at is None:
                room = own is None or (own.queued_tokens <= own.budget and not prefill_bound
                                       and p_stream_itl(own, busiest) < loaded)
                if loaded >= OPEN_AT * self._itl_target_s and room:
                    self._opened_at = now
                    self.openings += 1
                    logger.info("pdserve: serving whole requests too (decode's streams' ITL %.1f ms, target %.1f ms; "
                                "prefill share %.2f)", 1000 * loaded, 1000 * self._itl_target_s,
                                own.prefill_share if own else 0.0)
            elif (loaded < CLOSE_AT * self._itl_target_s or prefill_bound) and now - self._opened_at >= MIN_OPEN_S:
                self._opened_at = None
                logger.info("pdserve: prefill only again (decode's streams' ITL %.1f ms, target %.1f ms; "
                            "prefill share %.2f)", 1000 * loaded, 1000 * self._itl_target_s,
                            own.prefill_share if own else 0.0)
            return self._opened_at is not None


def p_stream_itl(own: PrefillLoad, status: DecodeStatus | None) -> float:
    """The ITL a stream P took now would see: the decode step of P's streams and one more, by D's
    fitted costs (the same model on like cores), stretched by the share of time P spends in steps
    with prompt tokens (0 where D's costs are not known yet: no objection)."""
    if status is None or status.overhead_s is None or status.per_decode_s is None:
        return 0.0
    return stretched_step(status.overhead_s, status.per_decode_s, own.decodes + 1, own.prefill_share)


def streams_itl(status: DecodeStatus) -> float | None:
    """How slowly a decode instance's streams advance now, by what it published (balance.py's
    `streams_now_itl`; None: not known, as for a D with no stream)."""
    return streams_now_itl(status.now_itl_s, costs_of(status), status.running_decodes)
