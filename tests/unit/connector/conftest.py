"""Connector unit tests fail on any internal error the vLLM-boundary guard swallowed: a hook that
raised would otherwise pass as its safe default answer."""

from __future__ import annotations

import logging

import pytest


@pytest.fixture(autouse=True)
def no_swallowed_internal_errors(caplog):
    caplog.set_level(logging.ERROR, logger="pdserve.connector")
    yield
    swallowed = [r for r in caplog.records if r.name == "pdserve.connector" and "internal error" in r.getMessage()]
    assert not swallowed, f"a guarded hook raised: {swallowed[0].getMessage()}\n{swallowed[0].exc_text or ''}"


@pytest.fixture
def live_process():
    """Start real child processes whose pid, start time and boot id an Instance can report as
    its liveness; `kill(liveness)` ends one for good. Every child is killed and reaped at the end."""
    import subprocess

    from pdserve.transfer.incarnation import boot_id, process_start_time

    children: list[subprocess.Popen] = []

    class Processes:
        def start(self) -> tuple[int, int, str]:
            child = subprocess.Popen(["sleep", "60"])
            children.append(child)
            start_time = process_start_time(child.pid)
            assert start_time is not None
            return child.pid, start_time, boot_id()

        def kill(self, liveness: tuple[int, int, str]) -> None:
            child = next(c for c in children if c.pid == liveness[0])
            child.kill()
            child.wait(timeout=5)

    yield Processes()
    for child in children:
        if child.poll() is None:
            child.kill()
        child.wait(timeout=5)
