"""What is in the host's /dev/shm, who holds it, and removing what a dead instance left there.

The fallback when `shm_namespace` is not available: before an instance starts the launcher takes a
snapshot; after its process group is gone it removes the entries that appeared since and that no
live process holds open (/proc/*/fd) or mapped (/proc/*/maps). Entries are compared by device and
inode, not by name: a process in a private mount namespace sees its own, unrelated /dev/shm under
the same path.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

logger = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"


@dataclass(frozen=True)
class ShmEntry:
    """One file in /dev/shm; `inode` is (device, inode number), its identity."""

    name: str
    size: int
    inode: tuple[int, int]


def list_entries(directory: str = SHM_DIR) -> dict[tuple[int, int], ShmEntry]:
    """The regular files in `directory` now, by inode."""
    entries = {}
    try:
        scan = list(os.scandir(directory))
    except OSError:
        return entries
    for item in scan:
        try:
            st = item.stat(follow_symlinks=False)
        except OSError:
            continue  # removed meanwhile
        if item.is_file(follow_symlinks=False):
            entries[(st.st_dev, st.st_ino)] = ShmEntry(item.name, st.st_size, (st.st_dev, st.st_ino))
    return entries


def holders(directory: str = SHM_DIR) -> dict[tuple[int, int], set[int]]:
    """Pids of the live processes holding each inode under `directory` open or mapped."""
    held: dict[tuple[int, int], set[int]] = {}
    prefix = directory.rstrip("/") + "/"
    for proc in os.scandir("/proc"):
        if not proc.name.isdigit():
            continue
        pid = int(proc.name)
        for inode in (*_open_files(pid, prefix), *_mapped_files(pid, prefix)):
            held.setdefault(inode, set()).add(pid)
    return held


def unheld_since(before: dict[tuple[int, int], ShmEntry], directory: str = SHM_DIR) -> list[ShmEntry]:
    """Entries of `directory` not in `before` that no live process holds."""
    added = [e for inode, e in list_entries(directory).items() if inode not in before]
    if not added:
        return []
    held = holders(directory)
    return [e for e in added if e.inode not in held]


def sweep(before: dict[tuple[int, int], ShmEntry], owner: str, directory: str = SHM_DIR) -> list[ShmEntry]:
    """Remove what `unheld_since(before)` finds (left by `owner`, named in the log); returns it."""
    removed = []
    for entry in unheld_since(before, directory):
        try:
            os.unlink(os.path.join(directory, entry.name))
            removed.append(entry)
        except FileNotFoundError:
            pass
        except OSError as exc:
            logger.warning("pdserve: cannot remove %s/%s left by %s: %s", directory, entry.name, owner, exc)
    if removed:
        total = sum(e.size for e in removed) / 2**20
        logger.info("pdserve: removed %d entries (%.0f MiB) %s left in %s: %s", len(removed), total, owner,
                    directory, ", ".join(sorted(e.name for e in removed)))
    return removed


def _open_files(pid: int, prefix: str) -> list[tuple[int, int]]:
    fd_dir = f"/proc/{pid}/fd"
    found = []
    try:
        fds = os.listdir(fd_dir)
    except OSError:
        return found  # gone, or not ours to read
    for fd in fds:
        path = f"{fd_dir}/{fd}"
        try:
            if os.readlink(path).startswith(prefix):
                st = os.stat(path)  # through the magic link: the file itself, in whatever namespace
                found.append((st.st_dev, st.st_ino))
        except OSError:
            continue
    return found


def _mapped_files(pid: int, prefix: str) -> list[tuple[int, int]]:
    found = []
    try:
        with open(f"/proc/{pid}/maps") as f:
            lines = [line for line in f if prefix in line]
    except OSError:
        return found
    for line in lines:
        fields = line.split(maxsplit=5)  # address perms offset dev inode path
        if len(fields) == 6 and fields[5].startswith(prefix):
            major, minor = (int(x, 16) for x in fields[3].split(":"))
            found.append((os.makedev(major, minor), int(fields[4])))
    return found
