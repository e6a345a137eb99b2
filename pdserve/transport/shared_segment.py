"""One POSIX shared-memory segment (a file in /dev/shm), created or attached, mapped with mmap.

We own segments ourselves (os.open + ftruncate + mmap) instead of using
multiprocessing.shared_memory, whose resource tracker unlinks segments behind our back when the
creating process exits. Names carry the creator's pid (`pdserve-<pid>-<token>-<suffix>`) so that
`sweep_stale_segments` can remove what a crashed process left behind.

`unlink_name()` goes further: it keeps an open descriptor and removes the name at once, so the
segment lives exactly as long as the owning process (even one killed with SIGKILL) and peers
open it as `/proc/<owner pid>/fd/<fd>` (same user only, which is what we want).

A peer names the segment we map read-write, so `attach` maps only what really is a pdserve
segment: a `pdserve-<pid>-...` name in /dev/shm that is a regular file (no symlink), or a
`/proc/<pid>/fd/<n>` whose target is `/dev/shm/pdserve-<that pid>-...` (" (deleted)" once
unlinked; the target reads so even when the owner's /dev/shm is a private mount in another
mount namespace). Segments are created with their pages allocated (`posix_fallocate`): a sparse
file on a too-small /dev/shm would turn into SIGBUS at the first touch.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import os
import re
import stat

from pdserve.errors import TransferError

logger = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
_PREFIX = "pdserve-"
MAX_NAME_CHARS = 255
_NAME_PART = re.compile(r"^[A-Za-z0-9_.]+$")
_OWNED_NAME = re.compile(r"^pdserve-(\d+)-")
_SEGMENT_NAME = re.compile(r"^pdserve-\d+-[A-Za-z0-9_.-]+\Z")
_PROC_FD = re.compile(r"^/proc/(\d+)/fd/\d+\Z")
_PROC_FD_TARGET = re.compile(r"^/dev/shm/pdserve-(\d+)-[A-Za-z0-9_.-]+(?: \(deleted\))?\Z")
_ATTACH_FLAGS = os.O_RDWR | os.O_NOCTTY | os.O_NONBLOCK | os.O_CLOEXEC


def segment_name_problem(name) -> str | None:
    """Why `name` cannot name a peer's segment (None if it can): `pdserve-<pid>-<...>` in
    /dev/shm, or `/proc/<pid>/fd/<n>`."""
    if not isinstance(name, str) or not name:
        return f"shm segment name must be a non-empty string, got {name!r:.80}"
    if len(name) > MAX_NAME_CHARS:
        return f"shm segment name is {len(name)} characters long (max {MAX_NAME_CHARS})"
    if not (_SEGMENT_NAME.match(name) or _PROC_FD.match(name)):
        return f"shm segment name {name!r} is neither pdserve-<pid>-<name> nor /proc/<pid>/fd/<n>"
    return None


def segment_name(token: str, suffix: str) -> str:
    """`pdserve-<our pid>-<token>-<suffix>`; token and suffix are [A-Za-z0-9_.]+."""
    for part in (token, suffix):
        if not _NAME_PART.match(part):
            raise ValueError(f"segment name part {part!r} must match [A-Za-z0-9_.]+")
    return f"{_PREFIX}{os.getpid()}-{token}-{suffix}"


class SharedSegment:
    """A mapped shm segment. `address` stays valid until `close()` (or for as long as a buffer
    exported from `mmap`, e.g. a torch tensor, still uses it)."""

    def __init__(self, name: str, size: int, mm: mmap.mmap, owner: bool):
        self.name = name
        self.size = size
        self.mmap = mm
        self.owner = owner
        self._anchor = ctypes.c_char.from_buffer(mm)  # pins the mapping while we hand out its address
        self.address = ctypes.addressof(self._anchor)
        self._closed = False
        self._fd: int | None = None

    @classmethod
    def create(cls, name: str, size: int) -> SharedSegment:
        """Create and map a new zero-filled segment; fails if `name` already exists."""
        if size <= 0:
            raise ValueError(f"segment size must be positive, got {size}")
        path = _path(name)
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        except FileExistsError:
            raise TransferError(f"shm segment {path} already exists") from None
        except OSError as e:
            raise TransferError(f"cannot create shm segment {path}: {e}") from e
        try:
            _allocate(fd, path, size)
            mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except (OSError, TransferError) as e:
            os.close(fd)
            os.unlink(path)
            if isinstance(e, TransferError):
                raise
            raise TransferError(f"cannot size/map shm segment {path} ({size} bytes): {e}") from e
        os.close(fd)
        return cls(name, size, mm, owner=True)

    @classmethod
    def attach(cls, name: str, size: int | None = None) -> SharedSegment:
        """Map an existing pdserve segment (all of it, or its first `size` bytes, which must
        exist); TransferError saying why when `name` is not one (see the module docstring)."""
        problem = segment_name_problem(name)
        if problem is not None:
            raise TransferError(problem)
        proc = _PROC_FD.match(name)
        path = name if proc else os.path.join(SHM_DIR, name)
        if proc:
            _check_proc_target(path, path, int(proc.group(1)))
        try:
            fd = os.open(path, _ATTACH_FLAGS | (0 if proc else os.O_NOFOLLOW))
        except FileNotFoundError:
            raise TransferError(f"shm segment {path} does not exist") from None
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise TransferError(f"shm segment {path} is a symbolic link, not a pdserve segment") from None
            raise TransferError(f"cannot open shm segment {path}: {e}") from e
        try:
            if proc:  # what we opened, not what the link said a moment ago
                _check_proc_target(f"/proc/self/fd/{fd}", path, int(proc.group(1)))
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise TransferError(f"shm segment {path} is not a regular file")
            if size is None:
                size = info.st_size
            if size <= 0 or info.st_size < size:
                raise TransferError(f"shm segment {path} has {info.st_size} bytes, need {size}")
            mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError as e:
            raise TransferError(f"cannot map shm segment {path}: {e}") from e
        finally:
            os.close(fd)
        return cls(name, size, mm, owner=False)

    def unlink_name(self) -> str:
        """Owner only: remove the /dev/shm name now, keep the segment alive through an open
        descriptor, and return the path peers attach with (`/proc/<pid>/fd/<fd>`)."""
        if not self.owner or self._fd is not None:
            raise TransferError(f"segment {self.name} has no name of ours to unlink")
        path = _path(self.name)
        self._fd = os.open(path, os.O_RDWR)
        os.unlink(path)
        self.owner = False
        self.name = f"/proc/{os.getpid()}/fd/{self._fd}"
        return self.name

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self, unlink: bool = True) -> None:
        """Unmap, and unlink the file when `unlink` and we created it. Idempotent.

        If a buffer exported from the mapping is still alive (a tensor placed here), the mapping
        stays until that buffer dies; the file is unlinked anyway.
        """
        if self._closed:
            return
        self._closed = True
        if unlink and self.owner:
            try:
                os.unlink(_path(self.name))
            except FileNotFoundError:
                pass
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        del self._anchor
        try:
            self.mmap.close()
        except BufferError:
            logger.debug("shm segment %s still exported; unmapped when its last user dies", self.name)

    def __enter__(self) -> SharedSegment:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"SharedSegment({self.name!r}, {self.size} B, {'closed' if self._closed else 'open'})"


def sweep_stale_segments() -> list[str]:
    """Unlink /dev/shm/pdserve-<pid>-* whose pid is no longer alive; returns the names removed."""
    removed = []
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return removed
    for name in names:
        match = _OWNED_NAME.match(name)
        if match is None or _pid_alive(int(match.group(1))):
            continue
        try:
            os.unlink(os.path.join(SHM_DIR, name))
            removed.append(name)
        except FileNotFoundError:
            pass
        except OSError as e:
            logger.warning("cannot remove stale shm segment %s: %s", name, e)
    if removed:
        logger.info("removed %d stale shm segments: %s", len(removed), ", ".join(sorted(removed)))
    return removed


def _pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _allocate(fd: int, path: str, size: int) -> None:
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        if e.errno != errno.ENOSPC:
            raise
        try:
            usage = os.statvfs(os.path.dirname(path))
            free = f"{usage.f_bavail * usage.f_frsize} bytes"
        except OSError:
            free = "unknown"
        raise TransferError(
            f"not enough space in {os.path.dirname(path)} for {os.path.basename(path)}: need {size} bytes, free {free}"
        ) from None


def _check_proc_target(link: str, path: str, pid: int) -> None:
    try:
        target = os.readlink(link)
    except FileNotFoundError:
        raise TransferError(f"shm segment {path} does not exist") from None
    except OSError as e:
        raise TransferError(f"cannot read shm segment link {path}: {e}") from e
    match = _PROC_FD_TARGET.match(target)
    if match is None or int(match.group(1)) != pid:
        raise TransferError(f"{path} points at {target!r:.200}, not at a pdserve segment of process {pid}")


def _path(name: str) -> str:
    if _PROC_FD.match(name):
        return name
    if not name or "/" in name or "\0" in name or name in (".", ".."):
        raise TransferError(f"bad shm segment name {name!r}")
    return os.path.join(SHM_DIR, name)
