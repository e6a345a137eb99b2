"""PrefillGate: on P, a prefill leg waits for D's word, follows it, or is prefilled once `wait_s` passed."""

from __future__ import annotations

from pdserve.placement.prefill_gate import PrefillGate, Verdict


def test_prefill_gate_waits_then_follows_d_or_times_out():
    clock = [0.0]
    gate = PrefillGate(1.0, clock=lambda: clock[0])
    assert gate.verdict("a") is Verdict.ASK
    assert gate.verdict("a") is Verdict.WAIT
    gate.on_decisions({"a": False, "stranger": True})
    assert gate.verdict("a") is Verdict.DROP and gate.dropped("a")
    gate.on_decisions({"a": True})  # the first word is final
    assert gate.verdict("a") is Verdict.DROP
    assert gate.verdict("b") is Verdict.ASK
    clock[0] = 1.5
    assert gate.verdict("b") is Verdict.PREFILL and gate.num_timed_out == 1
    gate.on_decisions({"b": False})  # too late: it is being prefilled
    assert gate.verdict("b") is Verdict.PREFILL
    gate.forget("a")
    gate.forget("b")
    assert len(gate) == 0
