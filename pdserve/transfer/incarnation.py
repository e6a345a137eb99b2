"""One process incarnation of a peer: who answered a handshake, and whether it is provably gone.

A restarted instance listens at the same address but is a new incarnation (new pid, new random
token in its identity), and it shares nothing with its predecessor: no transfer, mapping, copy
or message of the old one may touch it. Incarnations are compared by `identity`; the pid,
start time and boot id let a peer on the same host prove that an incarnation has died (its
pid is gone or now belongs to a younger process), which is what allows D to reuse blocks that
a dead P could otherwise still have been writing.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass


@functools.cache
def boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def process_start_time(pid: int) -> int | None:
    """Field 22 of /proc/<pid>/stat (clock ticks after boot), None if there is no such process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    try:
        return int(stat[stat.rindex(b")") + 2:].split()[19])
    except (ValueError, IndexError):
        return None


def process_cpu_ticks(pid: int) -> int | None:
    """utime + stime of /proc/<pid>/stat (clock ticks the process ran), None if there is none."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        fields = stat[stat.rindex(b")") + 2:].split()
        return int(fields[11]) + int(fields[12])
    except (OSError, ValueError, IndexError):
        return None


@dataclass(frozen=True)
class Incarnation:
    identity: str  # "<engine_id>/<pid>-<token>": unique per process, the envelope sender id
    pid: int = 0
    start_time: int = 0
    boot_id: str = ""

    @classmethod
    def this_process(cls, identity: str) -> Incarnation:
        pid = os.getpid()
        return cls(identity, pid, process_start_time(pid) or 0, boot_id())

    @property
    def same_host(self) -> bool:
        return bool(self.boot_id) and self.boot_id == boot_id()

    def is_gone(self) -> bool:
        """True only when provably dead: same host and its pid is gone or reused. A peer on
        another host is never declared gone here (that needs its own evidence)."""
        if not self.same_host or self.pid <= 0:
            return False
        started = process_start_time(self.pid)
        return started is None or started != self.start_time

    def cpu_ticks(self) -> int | None:
        """The CPU time this incarnation has run, in clock ticks: only for one on this host that
        is not gone, else None."""
        if not self.same_host or self.pid <= 0 or self.is_gone():
            return None
        return process_cpu_ticks(self.pid)
