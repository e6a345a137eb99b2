import http.server
import json
import threading

import pytest

from pdserve.bench.deployment import Endpoint
from pdserve.bench.plan import Workload
from pdserve.bench.warmup import warm_up
from pdserve.errors import LaunchError


def serve(statuses):
    """A server answering POSTs with the given statuses in turn (then 200), recording bodies."""
    bodies = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            bodies.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            status = statuses.pop(0) if statuses else 200
            self.send_response(status)
            self.end_headers()
            self.wfile.write(b'{"choices": []}')

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, bodies


def test_warm_up_retries_503_until_the_router_is_ready():
    server, bodies = serve([503, 503])
    try:
        warm_up(Endpoint(f"http://127.0.0.1:{server.server_port}", "m"), Workload(30, 4, 1), 2, timeout_s=20)
    finally:
        server.shutdown()
        server.server_close()
    assert len(bodies) == 4  # two retried, two answered
    assert all(b["model"] == "m" and b["max_tokens"] == 4 and b["ignore_eos"] for b in bodies)
    assert len({b["prompt"] for b in bodies}) == 2  # the two prompts differ


def test_warm_up_fails_on_other_errors():
    server, _ = serve([500])
    try:
        with pytest.raises(LaunchError, match="warm-up request"):
            warm_up(Endpoint(f"http://127.0.0.1:{server.server_port}", "m"), Workload(30, 4, 1), 1, timeout_s=5)
    finally:
        server.shutdown()
        server.server_close()
