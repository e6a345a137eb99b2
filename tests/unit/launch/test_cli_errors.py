"""Bad input to the CLI: refused before anything starts, as one line naming the flag, exit status 2."""

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve import cli
from pdserve.launch.cluster import Cluster

PORT = 18950


@pytest.fixture
def secrets(tmp_path):
    """Secret files of every kind, outside the work directory."""
    made = {"dir": tmp_path / "secret-dir", "empty": tmp_path / "empty", "open": tmp_path / "open",
            "good": tmp_path / "good", "missing": tmp_path / "missing"}
    made["dir"].mkdir()
    made["empty"].touch(mode=0o600)
    for name, mode in (("open", 0o644), ("good", 0o600)):
        made[name].write_text("k" * 32)
        made[name].chmod(mode)
    return made


@pytest.fixture
def work_dir(tmp_path, monkeypatch):
    """An empty work directory; starting a process or a cluster fails the test."""
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.setenv("PDSERVE_WORK_DIR", str(work))
    monkeypatch.delenv("PDSERVE_SECRET_FILE", raising=False)

    def started(*args, **kwargs):
        raise AssertionError(f"started something: {args} {kwargs}")

    monkeypatch.setattr(subprocess, "Popen", started)
    monkeypatch.setattr(Cluster, "start", started)
    return work


def refuse(argv: list[str], capsys) -> str:
    """Run the CLI in this process; return its one error line, having checked the exit status."""
    try:
        code = cli.main(argv)
    except SystemExit as exc:
        code = exc.code
    err = capsys.readouterr().err
    assert code == 2, (argv, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith(f"pdserve {argv[0]}: error: " if not argv[0].startswith("-") else "pdserve: error: ")
    return lines[0]


INSTANCE = ["instance", "--role", "prefill", "--router", "10.0.0.1:8002", "--host-ip", "10.0.0.2", "--model", "org/m"]
UP = ["up", "--port", str(PORT)]

CASES = [  # (argv, what the line must name); {good}, {open}... are the secret files above
    (["up", "--vllm-args", '"x'], "--vllm-args: shell-quoted words"),
    ([*UP, "--kv-cache", "1TiB"], "--kv-cache: a size from 16MiB to this machine's memory"),
    ([*UP, "--kv-cache", "lots"], "--kv-cache: a size such as 1GiB"),
    ([*UP, "--kv-cache", "1MiB"], "--kv-cache"),
    ([*UP, "--max-model-len", "-5"], "--max-model-len: a token count"),
    ([*UP, "--startup-timeout", "-1"], "--startup-timeout: a number of seconds > 0"),
    ([*UP, "--drain-timeout", "-1"], "--drain-timeout: a number of seconds >= 0"),
    ([*UP, "--drain-timeout", "nan"], "--drain-timeout"),
    (["up", "--port", "70000"], "--port: a port number in 1..65535 (got '70000')"),
    (["up", "--port", "65530"], "--port: a port in 1..65519"),
    ([*UP, "--mode", "bogus"], "--mode: invalid choice: 'bogus'"),
    ([*UP, "--model", "/nonexistent/model"], "--model: a built-in name (tiny, small, ARCH-tiny), a model directory or a Hugging Face id"),
    ([*UP, "--model", "{dir}"], "--model: a model directory holds config.json"),
    ([*UP, "--host", "notanip"], "--host: an IP address"),
    ([*UP, "--mode", "adaptive", "--slo", "ttft<<5"], "--slo: an SLO"),
    ([*UP, "--mode", "write", "--slo", "ttft<500"], "--slo is what adaptive placement protects"),
    ([*UP, "--prefill", "0"], "--prefill: a number of instances in 1..16"),
    ([*UP, "--decode", "17"], "--decode: a number of instances in 1..16"),
    ([*UP, "--prefill-budget", "5"], "--prefill-budget: a token count in 16.."),
    ([*UP, "--decode-budget", "abc"], "--decode-budget: a token count"),
    ([*UP, "--itl-target-ms", "0"], "--itl-target-ms: a number of milliseconds"),
    ([*UP, "--max-step-ms", "-3"], "--max-step-ms: a number of milliseconds"),
    ([*UP, "--restart", "sometimes"], "--restart: invalid choice"),
    ([*UP, "--log-dir", "{good}"], "--log-dir: a directory (this path is a file)"),
    ([*UP, "--mode", "write", "--prefill-serves-decode"], "--prefill-serves-decode: only in adaptive mode"),
    ([*UP, "--mode", "collocated", "--prefill", "2"], "--prefill 2 --decode 1 is for the modes"),
    ([*UP, "--prefill-tp", "0"], "--prefill-tp: a tensor-parallel size in 1..64 (got '0')"),
    ([*UP, "--decode-tp", "65"], "--decode-tp: a tensor-parallel size in 1..64 (got '65')"),
    ([*UP, "--decode-tp", "two"], "--decode-tp: a tensor-parallel size in 1..64"),
    ([*UP, "--config", "{yaml:prefill_tp: 0}"], "--prefill-tp: a tensor-parallel size in 1..64"),
    ([*UP, "--prefill-tp", "2"], "--prefill-tp: a tensor-parallel size other than 1 is for the prefill instances of "
                                 "the PD modes (write, read, adaptive, adaptive-read, nixl), not collocated (got 2)"),
    ([*UP, "--mode", "write", "--", "-tp", "2"], "-tp among vLLM's flags: give --prefill-tp / --decode-tp instead"),
    ([*UP, "leftover"], "unrecognized argument 'leftover' (vLLM's own flags go after --)"),
    ([*UP, "--config", "{missing}"], "--config: a readable YAML file"),
    (["up", "--config", "{yaml:port: 70000}"], "--port: a port number in 1..65535"),
    ([*UP, "--config", "{yaml:colour: blue}"], "--config: unknown key 'colour'"),
    ([*UP, "--config", "{yaml:mode: bogus}"], "--mode: one of"),
    ([*UP, "--config", "{yaml:enforce-eager: 3}"], "--config: enforce-eager: true or false"),
    ([*UP, "--config", "{yaml:- a list}"], "--config: a YAML mapping"),
    ([*UP, "--config", "{yaml:port: [1, 2]}"], "--config: port: a single value"),
    ([*UP, "--config", "{yaml:vllm_args: [{a: 1}]}"], "--config: vllm_args: a list of vLLM flags"),
    ([*UP, "--config", "{yaml:mode: [unclosed}"], "--config: a readable YAML file"),
    (["demo", "--requests", "0"], "--requests: a whole number >= 1"),
    (["demo", "--port", "0"], "--port: a port number"),
    ([*INSTANCE, "--secret-file", "{good}", "--connector-extra", "notjson"], "--connector-extra: a JSON object"),
    ([*INSTANCE, "--secret-file", "{good}", "--connector-extra", "[1]"], "--connector-extra: a JSON object"),
    ([*INSTANCE, "--secret-file", "{good}", "--cores", "abc"], "--cores: a list of CPUs"),
    ([*INSTANCE, "--secret-file", "{good}", "--cores", "4096"], "--cores: a list of CPUs this process may use"),
    ([*INSTANCE, "--secret-file", "{good}", "--cores", "1-0"], "--cores"),
    ([*INSTANCE, "--secret-file", "{good}", "--port", "70000"], "--port: a port number in 1..65535"),
    ([*INSTANCE, "--secret-file", "{good}", "--port", "65535"], "--port: at most 65533"),
    ([*INSTANCE, "--secret-file", "{good}", "--handshake-port", "0"], "--handshake-port: a port number"),
    ([*INSTANCE, "--secret-file", "{good}", "--tp", "0"], "--tp: a tensor-parallel size in 1..64 (got '0')"),
    ([*INSTANCE, "--secret-file", "{good}", "--tp", "2", "--port", "65532"], "--port: at most 65531: the 4 ports"),
    ([*INSTANCE, "--secret-file", "{good}", "--tp", "2", "--handshake-port", "8101", "--notify-port", "8102"],
     "--handshake-port: ports 8101..8102 (one per rank of --tp 2) overlap the notify ports 8102..8103"),
    ([*INSTANCE, "--secret-file", "{good}", "--", "--tensor-parallel-size", "2"], "give --tp instead"),
    ([*INSTANCE, "--secret-file", "{good}", "--notify-port", "x"], "--notify-port: a port number"),
    ([*INSTANCE, "--secret-file", "{good}", "--allowed-peers", "notanet/99"], "--allowed-peers: comma-separated"),
    ([*INSTANCE, "--secret-file", "{good}", "--transport", "pigeon"], "--transport: invalid choice"),
    ([*INSTANCE, "--secret-file", "{good}", "--mode", "both"], "--mode: invalid choice"),
    ([*INSTANCE, "--secret-file", "{good}", "extra"], "unrecognized argument 'extra'"),
    ([*INSTANCE, "--secret-file", "{dir}"], "--secret-file: a file, not a directory"),
    ([*INSTANCE, "--secret-file", "{missing}"], "--secret-file: an existing file"),
    ([*INSTANCE, "--secret-file", "{empty}"], "--secret-file: a non-empty file"),
    ([*INSTANCE, "--secret-file", "{open}"], "--secret-file: a file only its owner may read or write"),
    ([*INSTANCE[:-2], "--model", "tiny", "--secret-file", "{good}"], "--model: a model directory or a Hugging Face"),
    (["instance", "--role", "both", "--router", "10.0.0.1:8002", "--host-ip", "10.0.0.2", "--model", "o/m",
      "--secret-file", "{good}"], "--role: invalid choice"),
    ([*INSTANCE[:5], "--host-ip", "notanip", "--model", "o/m", "--secret-file", "{good}"], "--host-ip: an IP address"),
    ([INSTANCE[0], *INSTANCE[1:3], "--router", "10.0.0.1", *INSTANCE[5:], "--secret-file", "{good}"],
     "--router: HOST:PORT"),
    ([INSTANCE[0], *INSTANCE[1:3], "--router", "svc:99999", *INSTANCE[5:], "--secret-file", "{good}"],
     "--router: HOST:PORT"),
    ([INSTANCE[0], *INSTANCE[1:3], "--router", "bad_name!:80", *INSTANCE[5:], "--secret-file", "{good}"],
     "--router: HOST:PORT"),
    (["instance", "--role", "prefill"], "the following arguments are required: --router"),
    (["router", "--host-ip", "notanip", "--secret-file", "{good}"], "--host-ip: an IP address"),
    (["router", "--host-ip", "10.0.0.1", "--port", "99999", "--secret-file", "{good}"], "--port: a port number"),
    (["router", "--host-ip", "10.0.0.1", "--prometheus-port", "0", "--secret-file", "{good}"], "--prometheus-port"),
    (["router", "--host-ip", "10.0.0.1", "--discovery-port", "-1", "--secret-file", "{good}"], "--discovery-port"),
    (["router", "--host-ip", "10.0.0.1", "--secret-file", "{open}"], "--secret-file: a file only its owner"),
    (["router", "--host-ip", "10.0.0.1"], "--secret-file: the deployment's secret"),
    (["--work-dir", "{good}", "up"], "--work-dir: a directory (this path is a file)"),
]


def _fill(argv: list[str], secrets: dict[str, Path], tmp_path: Path) -> list[str]:
    out = []
    for word in argv:
        if word.startswith("{yaml:"):
            path = tmp_path / f"config-{len(out)}.yaml"
            path.write_text(word[len("{yaml:"):-1] + "\n")
            word = str(path)
        elif word.startswith("{"):
            word = str(secrets[word[1:-1]])
        out.append(word)
    return out


@pytest.mark.parametrize("argv, message", CASES, ids=[" ".join(a) for a, _ in CASES])
def test_bad_input_is_refused_at_the_edge(argv, message, secrets, work_dir, tmp_path, capsys):
    line = refuse(_fill(argv, secrets, tmp_path), capsys)
    assert message in line
    assert list(work_dir.iterdir()) == [], "something was written in the work directory"


def test_the_line_names_the_flag_the_rule_and_the_value(work_dir, capsys):
    assert refuse(["up", "--port", "70000"], capsys) == \
        "pdserve up: error: --port: a port number in 1..65535 (got '70000')"


def test_a_router_given_by_dns_name_is_accepted(secrets, capsys):
    code = cli.main([INSTANCE[0], *INSTANCE[1:3], "--router", "pdserve-router.prod.svc:8002", *INSTANCE[5:],
                     "--secret-file", str(secrets["good"]), "--print"])
    assert code == 0 and "pdserve-router.prod.svc" in capsys.readouterr().out


def pdserve(*args: str, work: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pdserve.cli", *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PDSERVE_WORK_DIR": str(work)})


def test_a_shell_quoting_error_is_one_line_from_the_command_line(tmp_path):
    result = pdserve("up", "--vllm-args", '"x', "--port", str(PORT), work=tmp_path)
    assert result.returncode == 2
    assert result.stderr.strip() == ("pdserve up: error: --vllm-args: shell-quoted words (No closing quotation) "
                                     "(got '\"x')")


@pytest.mark.parametrize("detach", [False, True])
def test_port_already_taken(detach, tmp_path):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 18951))
        sock.listen()
        result = pdserve("up", "--port", "18951", *(["--detach"] if detach else []), work=tmp_path)
    assert result.returncode == 1
    assert result.stderr.strip() == "pdserve: error: port 18951 already in use on 127.0.0.1 (choose another --port)"
