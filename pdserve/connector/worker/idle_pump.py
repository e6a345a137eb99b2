"""IdlePump: the transfer engine keeps moving while vLLM runs no step.

The engine is pumped from vLLM's worker hooks, once or more per engine step. An instance with no
request to run steps no engine loop, so without this a control message sent to it (a Release from
D for a transfer this P never had, say) would wait for the next request to be answered, and D
would keep a prompt waiting for as long. Between steps, this thread pumps the engine every
`period_s` instead.

It never runs inside a step: `step_started` and `step_ended` bracket vLLM's hooks, and the pump
checks them under the same lock those calls take, so the engine is only ever driven by one thread
at a time. Free of vLLM.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

logger = logging.getLogger("pdserve.connector")

IDLE_PUMP_S = 0.05  # between engine steps, the engine is pumped this often


class IdlePump:
    def __init__(self, pump: Callable[[], None], lock: threading.Lock, period_s: float = IDLE_PUMP_S):
        self._pump = pump
        self._lock = lock  # held by the caller around every engine call of a step's hooks
        self._period_s = period_s
        self._in_step = False
        self._ran = False  # a step ran since the last idle pump: the engine was pumped just now
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pdserve-idle-pump", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def step_started(self) -> None:
        """Call with the lock held, at the step's first hook."""
        self._in_step = True

    def step_ended(self) -> None:
        """Call with the lock held, at the step's last hook."""
        self._in_step = False
        self._ran = True

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=5.0)

    def _run(self) -> None:
        while not self._stop.wait(self._period_s):
            with self._lock:
                if self._in_step or self._stop.is_set():
                    continue
                if self._ran:  # steps are running: they pump
                    self._ran = False
                    continue
                try:
                    self._pump()
                except Exception:  # the engine's own errors are logged; this thread must survive them
                    logger.exception("pdserve: idle pump failed")
