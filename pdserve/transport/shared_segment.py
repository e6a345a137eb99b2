"""One POSIX shared-memory segment (a file in /dev/shm), created or attached, mapped with mmap.

We own segments ourselves (os.open + ftruncate + mmap) instead of using
multiprocessing.shared_memory, whose resource tracker unlinks segments behind our back when the
creating process exits. Names carry the creator's pid (`pdserve-<pid>-<token>-<suffix>`) so that
`sweep_stale_segments` can remove what a crashed process left behind.

`unlink_name()` goes further: it keeps an open descriptor and removes the name at once, so the
segment lives exactly as long as the owning process (even one killed with SIGKILL) and peers
open it as `/proc/<owner pid>/fd/<fd>` (same user only, which is what we want).
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import re

from pdserve.errors import TransferError

logger = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
_PREFIX = "pdserve-"
_NAME_PART = re.compile(r"^[A-Za-z0-9_.]+$")
_OWNED_NAME = re.compile(r"^pdserve-(\d+)-")
_PROC_FD = re.compile(r"^/proc/\d+/fd/\d+$")


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
            os.ftruncate(fd, size)
            mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError as e:
            os.close(fd)
            os.unlink(path)
            raise TransferError(f"cannot size/map shm segment {path} ({size} bytes): {e}") from e
        os.close(fd)
        return cls(name, size, mm, owner=True)

    @classmethod
    def attach(cls, name: str, size: int | None = None) -> SharedSegment:
        """Map an existing segment (all of it, or its first `size` bytes, which must exist)."""
        path = _path(name)
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:
            raise TransferError(f"shm segment {path} does not exist") from None
        except OSError as e:
            raise TransferError(f"cannot open shm segment {path}: {e}") from e
        try:
            actual = os.fstat(fd).st_size
            if size is None:
                size = actual
            if size <= 0 or actual < size:
                raise TransferError(f"shm segment {path} has {actual} bytes, need {size}")
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


def _path(name: str) -> str:
    if _PROC_FD.match(name):
        return name
    if not name or "/" in name or name in (".", ".."):
        raise ValueError(f"bad shm segment name {name!r}")
    return os.path.join(SHM_DIR, name)
