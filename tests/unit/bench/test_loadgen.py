import os
import sys
import time

import pytest

from pdserve.bench.loadgen import BenchClientError, BenchCommand, run_bench
from pdserve.bench.plan import Workload
from tests.unit.bench import synthetic


def command(tmp_path, rate=10.0):
    return BenchCommand("http://127.0.0.1:38000", "m", tmp_path / "tok", Workload(64, 4, 5), rate, 1001,
                        tmp_path / "raw" / "r1_s1.json", tmp_path / "traces" / "r1_s1.jsonl")


def test_argv_has_the_required_flags(tmp_path):
    argv = command(tmp_path).argv(tmp_path / "x.part")
    text = " ".join(argv)
    for flag in ("--dataset-name timed_trace", f"--dataset-path {tmp_path / 'traces' / 'r1_s1.jsonl'}",
                 "--ignore-eos", "--temperature 0", "--save-detailed", "--save-result",
                 "--timed-trace-chunk-hash-size 16", "--num-prompts 5", "--num-warmups 0",
                 f"--tokenizer {tmp_path / 'tok'}", "--result-filename x.part"):
        assert flag in text
    assert argv[1:5] == ["-m", "pdserve.vllm_cli", "bench", "serve"]


def fake_client(monkeypatch, script):
    monkeypatch.setattr(BenchCommand, "argv", lambda self, result_file: [sys.executable, "-c", script, str(result_file)])


def test_result_appears_only_after_a_clean_exit(tmp_path, monkeypatch):
    import json

    data = json.dumps(synthetic.point_data(met_n=3, ttft_n=0))
    fake_client(monkeypatch, f"import sys; open(sys.argv[1], 'w').write({data!r})")
    cmd = command(tmp_path)
    ticks = []
    run_bench(cmd, tmp_path / "log.txt", tick=ticks.append)
    assert cmd.result_path.exists() and not cmd.result_path.with_name("r1_s1.json.part").exists()


def test_failed_client_leaves_no_result(tmp_path, monkeypatch):
    fake_client(monkeypatch, "import sys; open(sys.argv[1], 'w').write('{}'); sys.exit(3)")
    cmd = command(tmp_path)
    with pytest.raises(BenchClientError, match="exited with 3"):
        run_bench(cmd, tmp_path / "log.txt")
    assert not cmd.result_path.exists()
    fake_client(monkeypatch, "import sys; open(sys.argv[1], 'w').write('{}')")
    with pytest.raises(BenchClientError, match="no usable result"):
        run_bench(cmd, tmp_path / "log.txt")


def test_deadline_and_interrupt_kill_the_whole_group(tmp_path, monkeypatch):
    pid_file = tmp_path / "grandchild.pid"
    script = ("import subprocess, sys, time; "
              f"p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
              f"open({str(pid_file)!r}, 'w').write(str(p.pid)); time.sleep(60)")
    fake_client(monkeypatch, script)
    cmd = command(tmp_path, rate=1000.0)
    with pytest.raises(BenchClientError, match="deadline"):
        run_bench(cmd, tmp_path / "log.txt", startup_s=1.5)
    _assert_gone(int(pid_file.read_text()))

    def interrupt(elapsed):
        if pid_file.exists() and elapsed > 0.5:
            raise KeyboardInterrupt

    pid_file.unlink()
    with pytest.raises(KeyboardInterrupt):
        run_bench(cmd, tmp_path / "log.txt", tick=interrupt, startup_s=30)
    _assert_gone(int(pid_file.read_text()))


def _assert_gone(pid):
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        try:  # a zombie whose parent died is reaped by init soon
            if open(f"/proc/{pid}/stat").read().split(")")[1].split()[0] == "Z":
                return
        except OSError:
            return
        time.sleep(0.05)
    pytest.fail(f"process {pid} survived")
