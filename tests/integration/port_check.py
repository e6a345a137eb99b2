"""After a cluster stops: which of its ports a server still could not bind, and who holds them.

A port is given a few seconds to come free (the processes are gone by then: the tests check that
first), and one still bound is reported with the kernel's sockets on it, owners included, so a
failure names its holder."""

from __future__ import annotations

import subprocess
import time

from pdserve.launch.ports import port_free

SETTLE_S = 10.0


def still_bound(ports, settle_s: float = SETTLE_S) -> str:
    """'' when every port is free within `settle_s`; otherwise the bound ports and `ss` lines on them."""
    deadline = time.monotonic() + settle_s
    while True:
        bound = [p for p in ports if not port_free(p)]
        if not bound or time.monotonic() >= deadline:
            break
        time.sleep(0.25)
    if not bound:
        return ""
    query = " or ".join(f"sport = :{p}" for p in bound)
    sockets = subprocess.run(["ss", "-tanpo", f"( {query} )"], capture_output=True, text=True, timeout=10)
    return f"ports still bound {settle_s:.0f} s after stop: {bound}\n{sockets.stdout}{sockets.stderr}"
