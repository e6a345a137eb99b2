"""Fake instances for Cluster tests: tiny HTTP servers (with a grandchild) instead of vLLM."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from pdserve.launch.process import ProcessSpec

SERVER = r"""
import http.server, subprocess, sys, time, signal
port, delay, behaviour = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])  # a grandchild, like vLLM's engine
if behaviour == "ignore-term":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
time.sleep(delay)
if behaviour == "die":
    print("loading model...\nRuntimeError: boom while loading", flush=True)
    sys.exit(3)
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
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

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def process_spec(self, run_dir: Path) -> ProcessSpec:
        argv = (sys.executable, "-c", SERVER, str(self.port), str(self.delay), self.behaviour)
        return ProcessSpec(self.name, argv, {}, run_dir / f"{self.name}.log", f"{self.url}/health")
