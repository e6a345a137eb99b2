"""A private /dev/shm for one process tree: its own mount namespace with its own tmpfs there.

vLLM and its children leave `psm_*` segments and `sem.mp-*` semaphores in /dev/shm when they are
SIGKILLed (hundreds of MB each). Run under `ShmNamespace.wrap(argv)`, whatever the tree puts in
/dev/shm lives in a tmpfs that the kernel frees once the last process of the namespace is gone,
however it died. The wrapper execs in place (`unshare` without --fork, `sh` ending in `exec`), so
the child's pid, process group, PR_SET_PDEATHSIG and signals are the wrapped program's own.

Only /dev/shm differs: /proc is shared, so a peer still attaches to pdserve's KV segments through
`/proc/<owner pid>/fd/<n>` (the connector unlinks the name at once and hands out that path).

Needs CAP_SYS_ADMIN (root, or a user namespace that grants it) and util-linux `unshare`.
`namespace_available()` tries it once per process; without it the launcher falls back to
sweeping what an instance left (`pdserve.launch.shm_sweep`).
"""

from __future__ import annotations

import functools
import logging
import shutil
import subprocess
from dataclasses import dataclass
from typing import NamedTuple

logger = logging.getLogger(__name__)

GIB = 1 << 30
# Room beyond the KV cache for vLLM's own segments (message queues of 160-250 MB each, semaphores),
# per tensor-parallel rank: each rank adds its own queues and all-reduce buffers. tmpfs size is a
# limit, not a reservation: pages are used only when written.
HEADROOM_BYTES = 4 * GIB
MOUNT_SOURCE = "pdserve-shm"  # the tmpfs's name in /proc/<pid>/mountinfo
_SCRIPT = 'mount -t tmpfs -o "$1" {source} /dev/shm || exit 125; shift; exec "$@"'


def tmpfs_bytes(kv_cache_bytes: int, tp: int = 1) -> int:
    """The tmpfs limit for an instance whose KV cache is `kv_cache_bytes`, all its `tp` ranks together
    (each rank's KV cache is a segment there)."""
    return kv_cache_bytes + HEADROOM_BYTES * tp


@dataclass(frozen=True)
class ShmNamespace:
    """How to run a command with a private tmpfs of at most `size_bytes` on /dev/shm."""

    size_bytes: int

    def mount_options(self) -> str:
        return f"size={self.size_bytes},mode=1777,nosuid,nodev"

    def wrap(self, argv: tuple[str, ...]) -> tuple[str, ...]:
        """`argv` run in a new mount namespace (private propagation, so nothing leaks back to the
        host's mounts) whose /dev/shm is a fresh tmpfs. Exit code 125 if the mount fails."""
        if not argv:
            raise ValueError("nothing to wrap")
        script = _SCRIPT.format(source=MOUNT_SOURCE)
        return ("unshare", "--mount", "--propagation", "private", "--", "sh", "-c", script, MOUNT_SOURCE,
                self.mount_options(), *argv)


class Confinement(NamedTuple):
    """A command ready to run, and whether the launcher must sweep /dev/shm after it (no private one)."""

    argv: tuple[str, ...]
    sweep_shm: bool


def confine(argv: tuple[str, ...], size_bytes: int) -> Confinement:
    """`argv` with a private /dev/shm of `size_bytes` where the machine allows it, else as it is."""
    if namespace_available():
        return Confinement(ShmNamespace(size_bytes).wrap(argv), sweep_shm=False)
    return Confinement(argv, sweep_shm=True)


@functools.cache
def namespace_available() -> bool:
    """Whether this machine lets us run a process with a private /dev/shm (tried once, logged once)."""
    why = _probe()
    if why:
        logger.warning("pdserve: cannot give vLLM instances a private /dev/shm (%s); falling back to sweeping "
                       "what each instance leaves there after it stops", why)
    return not why


def _probe() -> str:
    """'' when a wrapped `true` runs; else why not."""
    if shutil.which("unshare") is None:
        return "no unshare command"
    try:
        done = subprocess.run(ShmNamespace(1 << 20).wrap(("true",)), capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"unshare failed: {exc}"
    if done.returncode != 0:
        return f"unshare/mount exited with {done.returncode}: {done.stderr.strip()[-200:] or 'no output'}"
    return ""
