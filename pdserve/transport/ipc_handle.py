"""`IpcHandle`: what a process on the same host needs to map one of our device regions.

It carries the backend's own opening data (`fields`: for CUDA the tuple PyTorch's
`UntypedStorage._share_cuda_()` returns, for the CPU stand-in the shm path and size) and the
owner's incarnation: its pid and its start time (field 22 of /proc/<pid>/stat). A handle is bound
to that incarnation, as a shm segment path `/proc/<pid>/fd/<n>` is: `owner_gone` says when the
process that exported it has exited (or is a zombie, or its pid now names a younger process), and
the GPU transport then neither opens the handle nor issues another copy through it.
"""

from __future__ import annotations

import os
from typing import NamedTuple

from pdserve.errors import ProtocolError

IPC_KINDS = ("cuda", "shm")  # shm: the CPU stand-in (tests, `gpu_check.py --device cpu`)
MAX_FIELDS = 16
MAX_FIELD_BYTES = 4096


class IpcHandle(NamedTuple):
    kind: str
    owner_pid: int
    owner_start: int
    fields: tuple  # None, ints, bools, strings and bytes only: it travels in msgpack

    def to_wire(self) -> list:
        return [self.kind, self.owner_pid, self.owner_start, list(self.fields)]

    @classmethod
    def from_wire(cls, data) -> IpcHandle:
        """Parse a peer's handle; ProtocolError naming what is wrong."""
        if not (isinstance(data, list | tuple) and len(data) == 4):
            raise ProtocolError(f"ipc handle must be [kind, owner_pid, owner_start, fields], got {data!r:.100}")
        kind, pid, start, fields = data
        if kind not in IPC_KINDS:
            raise ProtocolError(f"ipc handle kind must be one of {IPC_KINDS}, got {kind!r:.40}")
        for name, value in (("owner_pid", pid), ("owner_start", start)):
            if isinstance(value, bool) or not isinstance(value, int) or not 0 < value < 1 << 62:
                raise ProtocolError(f"ipc handle {name} must be a positive integer, got {value!r:.40}")
        if not isinstance(fields, list | tuple) or len(fields) > MAX_FIELDS:
            raise ProtocolError(f"ipc handle fields must be a list of at most {MAX_FIELDS}, got {fields!r:.100}")
        for field in fields:
            if field is not None and not isinstance(field, int | str | bytes):  # bool is an int
                raise ProtocolError(f"ipc handle field of type {type(field).__name__} is not allowed")
            if isinstance(field, str | bytes) and len(field) > MAX_FIELD_BYTES:
                raise ProtocolError(f"ipc handle field of {len(field)} bytes (max {MAX_FIELD_BYTES})")
        return cls(kind, pid, start, tuple(fields))

    @classmethod
    def for_this_process(cls, kind: str, fields: tuple) -> IpcHandle:
        pid = os.getpid()
        start = process_start(pid)
        if start is None:
            raise RuntimeError("cannot read this process's start time from /proc")
        return cls(kind, pid, start, tuple(fields))

    def owner_gone(self) -> str | None:
        """Why the exporting incarnation is gone, or None while it runs."""
        start = process_start(self.owner_pid)
        if start is None:
            return f"process {self.owner_pid} that exported the region has exited"
        if start != self.owner_start:
            return f"process {self.owner_pid} that exported the region has exited (its pid was reused)"
        if process_state(self.owner_pid) in ("Z", "X", "x"):
            return f"process {self.owner_pid} that exported the region has exited (not yet reaped)"
        return None


def _stat_fields(pid: int) -> list[bytes] | None:
    """/proc/<pid>/stat after the command name: state is [0], start time [19]."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        return stat[stat.rindex(b")") + 2:].split()
    except (OSError, ValueError):
        return None


def process_start(pid: int) -> int | None:
    """The start time of process `pid` in clock ticks after boot; None when there is none."""
    fields = _stat_fields(pid)
    try:
        return None if fields is None else int(fields[19])
    except (ValueError, IndexError):
        return None


def process_state(pid: int) -> str | None:
    """The one-letter state of process `pid` (R, S, D, Z, ...); None when there is none."""
    fields = _stat_fields(pid)
    return None if not fields else fields[0].decode(errors="replace")
