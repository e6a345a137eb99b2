"""RemotePath: D's measure of a remote TTFT beyond P's compute."""

from __future__ import annotations

from pdserve.placement.remote_path import MAX_PENDING, MIN_SAMPLES, RemotePath
from tests.unit.placement.fake_clock import Clock


def test_a_sample_runs_from_the_decision_to_the_end_of_the_step_after_landing_less_the_compute():
    clock = Clock()
    path = RemotePath(clock=clock)
    path.placed("r", compute_s=0.160)
    clock.now += 0.200
    assert path.step_ended() == []  # not landed: no first token yet
    path.landed("r")
    clock.now += 0.030  # the step that computes its first token
    [sample] = path.step_ended()
    assert abs(sample - 0.070) < 1e-9  # 230 ms from the decision, 160 of them P's compute
    assert path.step_ended() == []  # counted once


def test_no_path_until_enough_samples_then_their_median():
    clock = Clock()
    path = RemotePath(clock=clock)
    for i in range(MIN_SAMPLES):
        path.placed(f"r{i}", compute_s=0.1)
        clock.now += 0.1 + (0.05 if i % 2 else 0.02)
        path.landed(f"r{i}")
        path.step_ended()
        assert (path.seconds() is None) == (i < MIN_SAMPLES - 1)
    assert abs(path.seconds() - 0.035) < 1e-9  # median of four 20-ms and four 50-ms samples


def test_the_path_follows_the_last_window_of_samples():
    clock = Clock()
    path = RemotePath(window=10, clock=clock)
    for i in range(30):
        path.placed(f"r{i}", compute_s=0.0)
        clock.now += 0.02 if i < 20 else 0.09
        path.landed(f"r{i}")
        path.step_ended()
    assert abs(path.seconds() - 0.09) < 1e-9


def test_a_compute_longer_than_the_wait_counts_as_no_path():
    clock = Clock()
    path = RemotePath(clock=clock)
    path.placed("r", compute_s=5.0)
    path.landed("r")
    clock.now += 0.1
    assert path.step_ended() == [0.0]


def test_forgotten_and_unknown_requests_give_no_sample_and_pending_ones_stay_bounded():
    clock = Clock()
    path = RemotePath(clock=clock)
    path.placed("gone", compute_s=0.1)
    path.forget("gone")
    path.landed("gone")
    path.landed("never-placed")
    assert path.step_ended() == []
    for i in range(MAX_PENDING + 10):
        path.placed(f"r{i}", compute_s=0.0)
    path.landed("r0")  # the oldest were forgotten
    path.landed(f"r{MAX_PENDING + 9}")
    assert len(path.step_ended()) == 1
