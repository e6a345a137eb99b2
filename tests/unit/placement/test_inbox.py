"""PlacementInbox: the worker thread's side of placement, what it reports and when it publishes."""

from __future__ import annotations

import time

from pdserve.placement.inbox import PUBLISH_EVERY_S, PlacementInbox
from tests.unit.placement.samples import load


def test_placement_inbox_reports_decisions_once():
    inbox = PlacementInbox(expiry_s=60)
    inbox.expect("r1", "t1", None)
    inbox.expect("r2", "t2", False)  # D's Release came first
    inbox.decided("t1", True)
    inbox.decided("t9", True)  # not awaited: nothing to report
    inbox.on_load(load(7))
    news = inbox.take()
    assert news.decided == {"r1": True, "r2": False}
    assert news.loads[("127.0.0.1", 6301)].queued_tokens == 7
    assert inbox.take() is None


def test_p_publishes_a_changed_queue_at_once_and_an_unchanged_one_at_most_every_period():
    inbox = PlacementInbox(expiry_s=60)
    assert inbox.publish_due((0, (), 0))
    assert not inbox.publish_due((0, (), 0))  # the same within the period: once is enough
    assert inbox.publish_due((512, ("t1",), 0))  # a new prompt in the queue: D must hear it now
    assert not inbox.publish_due((512, ("t1",), 0))
    time.sleep(PUBLISH_EVERY_S * 1.5)
    assert inbox.publish_due((512, ("t1",), 0))  # the period passed: again, as a heartbeat
