"""Fake instances for Cluster tests: tiny HTTP servers (with a grandchild) instead of vLLM, and
process trees that hold /dev/shm segments the way vLLM does."""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from pdserve.launch.process import ManagedProcess, ProcessSpec
from pdserve.launch.shm_namespace import Confinement, confine

SERVER = r"""
import http.server, os, subprocess, sys, time, signal
port, delay, behaviour = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
if len(sys.argv) > 4 and os.path.exists(sys.argv[4]):  # the test changes how the next start behaves
    behaviour, delay = open(sys.argv[4]).read().split()[0], float(open(sys.argv[4]).read().split()[1])
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])  # a grandchild, like vLLM's engine
if behaviour == "ignore-term":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
time.sleep(delay)
if behaviour == "die":
    print("loading model...\nRuntimeError: boom while loading", flush=True)
    sys.exit(3)
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        if self.path.startswith("/slow/"):  # /slow/<seconds>: a request that takes that long
            time.sleep(float(self.path.split("/")[2]))
        self.send_response(200 if behaviour != "never-healthy" else 503); self.end_headers(); self.wfile.write(b"ok")
    def log_message(self, *a): pass
http.server.ThreadingHTTPServer(("127.0.0.1", port), H).serve_forever()
"""


@dataclass(frozen=True)
class FakeInstance:
    name: str
    port: int
    delay: float = 0.2
    behaviour: str = "ok"  # ok | die | never-healthy | ignore-term
    override: Path | None = None  # when this file exists, a start reads "<behaviour> <delay>" from it
    role: str = "both"  # as InstanceSpec.role: plain vLLM

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def process_spec(self, run_dir: Path) -> ProcessSpec:
        argv = (sys.executable, "-c", SERVER, str(self.port), str(self.delay), self.behaviour,
                *([str(self.override)] if self.override else []))
        return ProcessSpec(self.name, argv, {}, run_dir / f"{self.name}.log", f"{self.url}/health")


# Like vLLM: the process and a grandchild each put a segment in /dev/shm and keep it mapped.
HOLDER = r"""
import mmap, os, subprocess, sys, time
token = sys.argv[1]
def segment(name):
    fd = os.open(f"/dev/shm/{name}", os.O_CREAT | os.O_RDWR, 0o600)
    os.ftruncate(fd, 1 << 20)
    mm = mmap.mmap(fd, 1 << 20)
    mm[:5] = b"hello"
    os.close(fd)
    return mm
if sys.argv[2:] == ["child"]:
    keep = segment(f"sem.{token}-child")
    print("child ready", flush=True)
else:
    keep = segment(f"psm_{token}")
    subprocess.Popen([sys.executable, sys.argv[0], token, "child"])
time.sleep(600)
"""


def shm_holder(tmp_path: Path, token: str, confine_with: int | None) -> ManagedProcess:
    """A started HOLDER whose two segments exist. `confine_with`: run it as the launcher runs an
    instance (private /dev/shm of that size, or the sweep); None: unconfined, swept after stop."""
    script = tmp_path / "holder.py"
    script.write_text(HOLDER)
    argv = (sys.executable, str(script), token)
    confined = confine(argv, confine_with) if confine_with else Confinement(argv, sweep_shm=True)
    process = ManagedProcess(ProcessSpec("holder", confined.argv, log_path=tmp_path / "holder.log",
                                         sweep_shm=confined.sweep_shm))
    process.start()
    try:
        deadline = time.monotonic() + 30
        while "child ready" not in "\n".join(process.log_tail()):  # both segments exist
            assert time.monotonic() < deadline and process.exit_code() is None, process.log_tail()
            time.sleep(0.05)
    except BaseException:
        process.stop(time.monotonic() + 5)
        raise
    return process


def host_entries(token: str) -> list[str]:
    """Names in the host's /dev/shm that contain `token`."""
    return sorted(name for name in os.listdir("/dev/shm") if token in name)
