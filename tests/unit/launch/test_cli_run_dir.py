"""`pdserve up`'s run directory: named by time and mode under the work dir, the logs written there and kept."""

from pathlib import Path

from pdserve.cli import parse_args
from pdserve.launch.cli import options_from, with_run_dir
from pdserve.launch.cluster import Cluster
from pdserve.launch.modes import Deployment, with_front
from tests.unit.launch.fakes import FakeInstance

BASE = 18970


def test_the_run_directory_is_new_under_the_work_dir_and_named_by_mode(tmp_path, monkeypatch):
    monkeypatch.setenv("PDSERVE_WORK_DIR", str(tmp_path))
    options = with_run_dir(options_from(parse_args(["up", "--mode", "write", "--port", "18700"])))
    assert options.log_dir.parent == tmp_path / "runs" and options.log_dir.name.endswith("-write-18700")
    assert not options.log_dir.exists()  # created when the deployment starts, not when flags are read
    given = with_run_dir(options_from(parse_args(["up", "--log-dir", str(tmp_path / "mine")])))
    assert given.log_dir == tmp_path / "mine"


def test_logs_are_written_in_the_log_dir_and_kept_after_stop(tmp_path):
    logs = tmp_path / "run"
    cluster = Cluster(with_front(Deployment((FakeInstance("a", BASE + 1),)), drain_timeout=1), log_dir=logs)
    cluster.start()
    try:
        cluster.wait_healthy(30)
        assert (logs / "a.log").exists() and (logs / "front.log").exists()  # readable while it runs
    finally:
        cluster.stop()
    assert not cluster.run_dir.exists()  # the scratch (ipc sockets, temp files) goes
    assert sorted(p.name for p in logs.iterdir()) == ["a.log", "front.log"]
    assert Path(logs / "front.log").stat().st_size > 0
