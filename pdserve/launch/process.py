"""One child process of a launch: started in its own session, health-checked, stopped as a group."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from pdserve.errors import LaunchError
from pdserve.launch.shm_sweep import list_entries, sweep
from pdserve.lifecycle import die_with_parent

_ERROR_LINE = re.compile(r"error|exception|killed|cannot|failed", re.IGNORECASE)
_PDSERVE_ERROR = re.compile(r"pdserve\.errors\.ConfigError: (.+)")  # a refusal of ours, raised inside vLLM


@dataclass(frozen=True)
class ProcessSpec:
    """What to run: argv, environment overlay, where its output goes, and how to tell it is ready.

    sweep_shm: after the process group is gone, remove what appeared in /dev/shm since it started
    and nobody holds (the fallback where it cannot have a private /dev/shm; see shm_namespace).
    """

    name: str
    argv: tuple[str, ...]
    env: dict[str, str] = field(default_factory=dict)
    log_path: Path | None = None
    health_url: str | None = None
    sweep_shm: bool = False


class ManagedProcess:
    """A child in a new session (so one signal reaches all its descendants) with a log file.

    Lifecycle: start() once, then healthy()/exit_code() while it runs, stop() (idempotent).
    Once it has exited, respawn() runs the same spec again (same argv, ports, pinning, log file).
    """

    def __init__(self, spec: ProcessSpec) -> None:
        self.spec = spec
        self._popen: subprocess.Popen | None = None
        self._shm_before: dict | None = None  # /dev/shm at the last start, when spec.sweep_shm

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def pid(self) -> int | None:
        return self._popen.pid if self._popen else None

    def start(self) -> None:
        if self._popen is not None:
            raise LaunchError(f"{self.name} already started")
        self._spawn()

    def respawn(self, deadline: float, note: str) -> None:
        """Start the spec again after the process exited: first stop what is left of its group
        (by `deadline`), then append `note` to its log and start it."""
        if self._popen is None or self.exit_code() is None:
            raise LaunchError(f"{self.name} cannot be respawned: {'not started' if self._popen is None else 'running'}")
        self.stop(deadline)
        if self.spec.log_path is not None:
            with open(self.spec.log_path, "a") as log:
                log.write(f"--- pdserve: {note}\n")
        self._spawn()

    def _spawn(self) -> None:
        if self.spec.sweep_shm:
            self._shm_before = list_entries()
        log = open(self.spec.log_path, "ab") if self.spec.log_path else subprocess.DEVNULL
        try:
            self._popen = subprocess.Popen(
                self.spec.argv, env={**os.environ, **self.spec.env}, stdin=subprocess.DEVNULL,
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=die_with_parent,
            )
        except OSError as exc:
            raise LaunchError(f"cannot start {self.name} ({self.spec.argv[0]}): {exc}") from exc
        finally:
            if log is not subprocess.DEVNULL:
                log.close()

    def exit_code(self) -> int | None:
        """None while running (or not started)."""
        return self._popen.poll() if self._popen else None

    def healthy(self, timeout: float = 2.0) -> bool:
        if self.spec.health_url is None:
            return self.exit_code() is None
        try:
            with urllib.request.urlopen(self.spec.health_url, timeout=timeout) as resp:
                return resp.status == 200
        except (urllib.error.URLError, OSError, ValueError):
            return False

    def last_error(self, tail: list[str] | None = None) -> str:
        """pdserve's own refusal when the log holds one (a ConfigError raised inside vLLM, whose last
        line only says the engine failed), else the last line of the tail that looks like an error
        (else its last line), shortened."""
        tail = self.log_tail(200) if tail is None else tail
        ours = [m.group(1) for line in tail if (m := _PDSERVE_ERROR.search(line))]
        if ours:
            return ours[-1].strip()[-300:]
        tail = tail[-40:]
        errors = [line for line in tail if _ERROR_LINE.search(line) and not line.startswith("--- pdserve:")]
        return (errors or tail or ["no output"])[-1].strip()[-300:]

    def log_tail(self, lines: int = 20) -> list[str]:
        path = self.spec.log_path
        if path is None or not path.exists():
            return []
        with open(path, errors="replace") as f:
            return [line.rstrip("\n") for line in deque(f, maxlen=lines)]

    def signal_group(self, sig: int) -> bool:
        """Send `sig` to the child's process group; False when no member is left."""
        if self._popen is None:
            return False
        try:
            os.killpg(self._popen.pid, sig)
            return True
        except ProcessLookupError:
            return False

    def alive(self) -> bool:
        """Whether any live (non-zombie) process of the child's group exists; the leader may be gone."""
        if self._popen is None:
            return False
        self._popen.poll()  # reap the leader
        return bool(group_members(self._popen.pid))

    def stop(self, deadline: float) -> None:
        """SIGTERM the group, wait until `deadline` (time.monotonic), then SIGKILL what is left."""
        if self._popen is None:
            return
        self.signal_group(signal.SIGTERM)
        while self.alive() and time.monotonic() < deadline:
            time.sleep(0.1)
        if self.alive():
            self.signal_group(signal.SIGKILL)
            kill_deadline = time.monotonic() + 5
            while self.alive() and time.monotonic() < kill_deadline:
                time.sleep(0.05)
        try:
            self._popen.wait(timeout=1)
        except subprocess.TimeoutExpired:
            pass
        if self._shm_before is not None and not self.alive():
            sweep(self._shm_before, self.name)
            self._shm_before = None


def group_members(pgid: int) -> list[int]:
    """Pids of the non-zombie processes whose process group is `pgid` (from /proc)."""
    members = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] not in (b"Z", b"X"):
            members.append(int(entry.name))
    return members
