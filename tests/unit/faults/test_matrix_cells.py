"""The fault matrix's cells for a prefill of several ranks, and how one rank's worker is found."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from pdserve.faults.matrix import cells, rank_worker, restart_and_kill_cells

TITLED = "import setproctitle, sys, time; setproctitle.setproctitle(sys.argv[1]); print(flush=True); time.sleep(60)"
# the leader of a new session starts a follower (same process group), prints its pid, then titles itself
LEADER = f"""import subprocess, sys
follower = subprocess.Popen([sys.executable, "-c", {TITLED!r}, "VLLM::Worker_TP1"], stdout=subprocess.PIPE)
follower.stdout.readline()
print(follower.pid, flush=True)
exec({TITLED!r})
"""


def test_a_prefill_of_two_ranks_adds_a_cell_that_kills_its_last_rank_alone():
    assert not any(c.kill_rank is not None for c in cells("write"))
    for mode in ("write", "read"):
        chosen = restart_and_kill_cells(mode, prefill_tp=2)
        assert [c.name for c in chosen] == ["prefill killed", "decode killed", "prefill restarted",
                                            "decode restarted", "prefill rank 1 killed"]
        (rank_cell,) = [c for c in chosen if c.kill_rank is not None]
        assert (rank_cell.kill, rank_cell.kill_rank) == ("prefill", 1) and rank_cell.repeat > 1


@pytest.fixture
def titled_group():
    """A process group of two processes titled as vLLM titles the workers of ranks 0 and 1."""
    leader = subprocess.Popen([sys.executable, "-c", LEADER, "VLLM::Worker_TP0"], start_new_session=True,
                              stdout=subprocess.PIPE, text=True)
    follower = int(leader.stdout.readline())
    leader.stdout.readline()  # the leader has titled itself
    yield leader.pid, follower
    os.killpg(leader.pid, signal.SIGKILL)
    leader.wait()


def test_the_worker_of_a_rank_is_found_in_its_instances_process_group_only(titled_group):
    leader, follower = titled_group
    assert rank_worker(leader, 0) == leader
    assert rank_worker(leader, 1) == follower
    with pytest.raises(ProcessLookupError, match="no worker of rank 2"):
        rank_worker(leader, 2)
    with pytest.raises(ProcessLookupError):
        rank_worker(os.getpgid(0), 1)  # not in the test's own group
