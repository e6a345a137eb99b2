"""IdlePump: between vLLM steps the engine is still pumped; inside a step it never is."""

from __future__ import annotations

import threading
import time

from pdserve.connector.worker.idle_pump import IdlePump

PERIOD_S = 0.01


class Engine:
    def __init__(self):
        self.pumps = 0
        self.in_step = False
        self.pumped_in_step = False

    def pump(self):
        self.pumps += 1
        self.pumped_in_step |= self.in_step


def _pump(engine: Engine, lock: threading.Lock, period_s: float = PERIOD_S) -> IdlePump:
    pump = IdlePump(engine.pump, lock, period_s=period_s)
    pump.start()
    return pump


def test_an_idle_instance_is_pumped_and_the_thread_ends_on_close():
    engine, lock = Engine(), threading.Lock()
    pump = _pump(engine, lock)
    try:
        deadline = time.monotonic() + 5
        while engine.pumps < 3:
            assert time.monotonic() < deadline, "an idle engine was not pumped"
            time.sleep(PERIOD_S)
    finally:
        pump.close()
    assert not any(t.name == "pdserve-idle-pump" and t.is_alive() for t in threading.enumerate())
    after = engine.pumps
    time.sleep(5 * PERIOD_S)
    assert engine.pumps == after


def test_never_pumps_inside_a_step_even_a_long_one():
    engine, lock = Engine(), threading.Lock()
    pump = _pump(engine, lock)
    try:
        with lock:
            pump.step_started()
            engine.in_step = True
        time.sleep(20 * PERIOD_S)  # a long forward pass: the hooks hold no lock meanwhile
        with lock:
            engine.in_step = False
            pump.step_ended()
        assert not engine.pumped_in_step
    finally:
        pump.close()


def test_steps_that_keep_running_are_left_to_pump_themselves():
    engine, lock = Engine(), threading.Lock()
    period_s = 0.05  # a step every ~2 ms: each period sees many
    pump = _pump(engine, lock, period_s)
    try:
        end = time.monotonic() + 20 * period_s
        while time.monotonic() < end:  # back-to-back steps, as a busy instance runs them
            with lock:
                pump.step_started()
                pump.step_ended()
            time.sleep(0.002)
        assert engine.pumps == 0
    finally:
        pump.close()
