"""A leg's status moves only along leg.py's transitions; any other raises naming both states."""

import pytest

from pdserve.connector.scheduler.legs.base import IllegalTransition, Leg, LegStatus
from tests.unit.connector.scheduler.scheduler_fakes import ROUTER_ID, FakeRequest


def test_a_received_leg_cannot_be_released_and_the_error_names_expected_and_actual():
    leg = Leg(FakeRequest(ROUTER_ID, None, 16), None)
    leg.to(LegStatus.RECEIVING)
    leg.to(LegStatus.RECEIVED)
    with pytest.raises(IllegalTransition) as raised:
        leg.to(LegStatus.RELEASED)
    assert raised.value.actual is LegStatus.RECEIVED and raised.value.expected == frozenset()
    assert "released" in str(raised.value) and "received" in str(raised.value)


def test_a_leg_waiting_its_turn_can_only_be_released():
    leg = Leg(FakeRequest(ROUTER_ID, None, 16), None)
    leg.to(LegStatus.AWAITING_TURN)
    with pytest.raises(IllegalTransition) as raised:
        leg.to(LegStatus.RECEIVING)
    assert raised.value.expected == frozenset({LegStatus.RELEASED})
    leg.to(LegStatus.RELEASED)
    assert leg.status is LegStatus.RELEASED
