"""Bad input to the CLI: one line naming the problem, non-zero exit, nothing left running."""

import socket
import subprocess
import sys

import pytest


def pdserve(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pdserve.cli", *args], capture_output=True, text=True, timeout=120)


def running_with(port: int) -> list[str]:
    out = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if f"--port {port}" in line and "pdserve" in line]


@pytest.mark.parametrize("args, message", [
    (("up", "--mode", "bogus", "--port", "18950"), "unknown mode 'bogus'"),
    (("up", "--model", "/nonexistent/model", "--port", "18950"), "model directory /nonexistent/model does not exist"),
    (("up", "--kv-cache", "lots", "--port", "18950"), "cannot read 'lots' as a size"),
    (("make-model", "/tmp/pdserve-never", "--size", "huge"), "unknown model size 'huge'"),
])
def test_bad_input_gives_one_line_error(args, message):
    result = pdserve(*args)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [f"pdserve: error: {result.stderr.split('error: ', 1)[1].strip()}"]
    assert message in result.stderr
    assert running_with(18950) == []


@pytest.mark.parametrize("detach", [False, True])
def test_port_already_taken(detach):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 18951))
        sock.listen()
        result = pdserve("up", "--port", "18951", *(["--detach"] if detach else []))
    assert result.returncode == 1
    assert result.stderr.strip() == "pdserve: error: port 18951 already in use on 127.0.0.1 (choose another --port)"
    assert running_with(18951) == []
