"""Two "hosts" on one machine: network namespaces joined by a veth pair, each its own PID namespace.

    with TwoHosts() as hosts:            # needs root (ip netns, unshare)
        hosts.start("a", "router", ["pdserve", "router", "--host-ip", hosts.ip("a"), ...])
        hosts.start("b", "decode", [...])
        hosts.run("a", ["curl", ...])    # a short command inside host a

Host a has 10.200.0.1/24, host b 10.200.0.2/24, on the veth pair only (plus loopback, up in each);
nothing is routed outside them. Every process is started as `ip netns exec NS unshare --pid --fork
--mount-proc --kill-child`, so each sees its own /proc: a /proc/<pid>/fd path of the other host does
not open, and pdserve's same-host proof fails across them as it would between machines (so
transport auto picks NIXL). Everything created (processes, namespaces, veth) is removed on exit,
also when the block raises, and on SIGTERM (turned into SystemExit while the block runs).
"""

from __future__ import annotations

import logging
import os
import secrets
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from pdserve.errors import LaunchError

logger = logging.getLogger(__name__)

ADDRESSES = {"a": "10.200.0.1", "b": "10.200.0.2"}
PREFIX_LEN = 24
STOP_DEADLINE_S = 20.0


@dataclass
class HostProcess:
    host: str
    name: str
    popen: subprocess.Popen
    log: Path


class TwoHosts:
    def __init__(self, log_dir: Path, tag: str | None = None):
        tag = tag or secrets.token_hex(3)
        self.namespaces = {h: f"pds{h}-{tag}" for h in ADDRESSES}
        self.veths = {h: f"v{h}-{tag}" for h in ADDRESSES}
        self.log_dir = log_dir
        self.processes: list[HostProcess] = []
        self._previous_sigterm = None

    def ip(self, host: str) -> str:
        return ADDRESSES[host]

    def __enter__(self) -> TwoHosts:
        self._previous_sigterm = signal.signal(signal.SIGTERM, _exit_on_sigterm)
        try:
            self._create()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def _create(self) -> None:
        for ns in self.namespaces.values():
            _ip("netns", "add", ns)
        _ip("link", "add", self.veths["a"], "type", "veth", "peer", "name", self.veths["b"])
        for host, ns in self.namespaces.items():
            _ip("link", "set", self.veths[host], "netns", ns)
            _ip("-n", ns, "addr", "add", f"{ADDRESSES[host]}/{PREFIX_LEN}", "dev", self.veths[host])
            _ip("-n", ns, "link", "set", self.veths[host], "up")
            _ip("-n", ns, "link", "set", "lo", "up")

    def wrap(self, host: str, argv: list[str]) -> list[str]:
        """`argv` as a process of `host` (its network namespace, a PID namespace of its own)."""
        return ["ip", "netns", "exec", self.namespaces[host],
                "unshare", "--pid", "--fork", "--mount-proc", "--kill-child", *argv]

    def start(self, host: str, name: str, argv: list[str], env: dict[str, str] | None = None) -> HostProcess:
        """Start a long-running process on `host`, its output in <log_dir>/<name>.log."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log = self.log_dir / f"{name}.log"
        with open(log, "wb") as out:
            popen = subprocess.Popen(self.wrap(host, argv), stdout=out, stderr=subprocess.STDOUT,
                                     env={**os.environ, **(env or {})}, start_new_session=True)
        process = HostProcess(host, name, popen, log)
        self.processes.append(process)
        return process

    def run(self, host: str, argv: list[str], timeout: float = 60.0) -> subprocess.CompletedProcess:
        """A short command on `host`; its output captured."""
        return subprocess.run(self.wrap(host, argv), capture_output=True, text=True, timeout=timeout)

    def stop(self, process: HostProcess, signum: int = signal.SIGTERM) -> None:
        """Signal the process's group, wait up to the deadline, then SIGKILL it."""
        _killpg(process.popen, signum)
        try:
            process.popen.wait(STOP_DEADLINE_S)
        except subprocess.TimeoutExpired:
            _killpg(process.popen, signal.SIGKILL)
            process.popen.wait(STOP_DEADLINE_S)

    def close(self) -> None:
        """Stop every process, then delete the namespaces (which removes the veth pair). Idempotent."""
        for process in self.processes:
            _killpg(process.popen, signal.SIGTERM)
        deadline = time.monotonic() + STOP_DEADLINE_S
        for process in self.processes:
            try:
                process.popen.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            _killpg(process.popen, signal.SIGKILL)
            try:
                process.popen.wait(STOP_DEADLINE_S)
            except subprocess.TimeoutExpired:
                logger.error("process %s on host %s survived SIGKILL", process.name, process.host)
        self.processes.clear()
        for ns in self.namespaces.values():
            if _netns_exists(ns):
                _ip("netns", "del", ns, check=False)
        if self._previous_sigterm is not None:
            signal.signal(signal.SIGTERM, self._previous_sigterm)
            self._previous_sigterm = None

    def leftovers(self) -> list[str]:
        """Namespaces or veths of ours that still exist (empty after close)."""
        out = [ns for ns in self.namespaces.values() if _netns_exists(ns)]
        links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
        return out + [v for v in self.veths.values() if f" {v}@" in links or f" {v}:" in links]


def _exit_on_sigterm(signum, frame):
    raise SystemExit(128 + signum)


def _ip(*args: str, check: bool = True) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and done.returncode != 0:
        raise LaunchError(f"ip {' '.join(args)} failed: {done.stderr.strip()}")


def _netns_exists(name: str) -> bool:
    return os.path.exists(f"/run/netns/{name}")


def _killpg(popen: subprocess.Popen, signum: int) -> None:
    if popen.poll() is not None:
        return
    try:
        os.killpg(popen.pid, signum)
    except ProcessLookupError:
        pass
