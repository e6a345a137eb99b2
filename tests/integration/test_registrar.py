"""Registration that cannot be forged, across two network namespaces (pdserve/bench/hosts/netns.py).

Host a runs `pdserve router` (the registrar with the real vllm-router as its child). Host b runs
two instances that register with the deployment's secret, and four forgers: a prefill and a
decode instance registering the way vllm-router itself accepts (a bare map), and a prefill and a
decode instance signing with a guessed secret. Requests through the router must reach only the
signed instances, and the router's own discovery socket must not be reachable from host b.
Finally, a bare registration sent from host a itself to that loopback socket does get requests:
the forgers would have been served had they reached it, and it is the one door left open (to
processes on the router's host, as the registrar's docstring says).

The instances are fake (HTTP servers answering like vLLM with PDConnector, registering through
pdserve's own heartbeat code): what is under test is the registration path, and two real vLLM
instances in the namespaces take minutes to start on a 2-core machine where this runs in ~30 s.
`python -m tests.integration.test_registrar ...` is what runs inside the namespaces.
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import threading
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROUTER_PORT = 30000
DISCOVERY = ROUTER_PORT + 2  # the registrar
ROUTER_DISCOVERY = ROUTER_PORT + 3  # vllm-router's own discovery socket, 127.0.0.1 only
SIGNED = {"P": 30010, "D": 30020}
UNSIGNED = {"P": 30030, "D": 30031}
WRONG_SECRET = {"P": 30040, "D": 30041}
NUM_REQUESTS = 12


def test_a_forged_registration_from_another_namespace_gets_no_traffic(tmp_path: Path):
    from pdserve.bench.hosts.netns import TwoHosts
    from pdserve.control.secret import SECRET_FILE_ENV, generate_secret_file

    secret = tmp_path / "secret"
    generate_secret_file(secret)
    with TwoHosts(tmp_path / "logs") as hosts:
        a, b = hosts.ip("a"), hosts.ip("b")
        router = hosts.start("a", "router", [sys.executable, "-m", "pdserve.cli", "router", "--host-ip", a,
                                             "--port", str(ROUTER_PORT)], env={SECRET_FILE_ENV: str(secret)})
        hosts.start("b", "instances", [*_me(), "instances", "--registrar", f"{a}:{DISCOVERY}", "--host", b,
                                       "--secret-file", str(secret)])
        workers = {f"{kind} {role}": f"http://{b}:{port}" for kind, ports in
                   (("signed", SIGNED), ("unsigned", UNSIGNED), ("wrong secret", WRONG_SECRET))
                   for role, port in ports.items()}
        served = _client(hosts, workers)
        assert served["statuses"] == [200] * NUM_REQUESTS, served
        assert served["counts"] == {"signed P": NUM_REQUESTS, "signed D": NUM_REQUESTS, "unsigned P": 0,
                                    "unsigned D": 0, "wrong secret P": 0, "wrong secret D": 0}, served
        assert _probe(hosts, "b", a, ROUTER_DISCOVERY) == "refused"
        assert _probe(hosts, "b", a, DISCOVERY) == "open"
        assert _probe(hosts, "a", "127.0.0.1", ROUTER_DISCOVERY) == "open"
        log = router.log.read_text()
        assert "registrar server rejected" in log and "bad MAC" in log, log[-3000:]

        hosts.start("a", "local-forger", [*_me(), "forge", "--to", f"127.0.0.1:{ROUTER_DISCOVERY}",
                                          "--worker", f"{b}:{UNSIGNED['P']}"])
        time.sleep(2.0)  # a few bare beats have reached the router
        served = _client(hosts, workers)
        assert served["counts"]["unsigned P"] > 0, served
        assert router.popen.poll() is None, "the router died"
    assert hosts.leftovers() == [] and not hosts.processes


def _client(hosts, workers: dict[str, str]) -> dict:
    out = _run(hosts, "a", ["client", "--router", f"http://{hosts.ip('a')}:{ROUTER_PORT}",
                            "--workers", json.dumps(workers)], timeout=120)
    return json.loads(out)


def _probe(hosts, host: str, ip: str, port: int) -> str:
    return _run(hosts, host, ["probe", ip, str(port)], timeout=30).strip()


def _run(hosts, host: str, args: list[str], timeout: float) -> str:
    done = hosts.run(host, [*_me(), *args], timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def _me() -> list[str]:
    return [sys.executable, "-m", "tests.integration.test_registrar"]


# ---- inside a namespace ------------------------------------------------------------------------

def run_instances(args) -> None:
    """The signed instances and the forgers of host b, until killed."""
    from pdserve.control.codec import Codec
    from pdserve.control.registration import RegistrationHeartbeat
    from pdserve.control.secret import load_secret
    from tests.unit.registrar.test_registrar_process import FakeWorker, UnsignedBeat, registration

    host, port = args.registrar.rsplit(":", 1)
    for worker_port in (*SIGNED.values(), *UNSIGNED.values(), *WRONG_SECRET.values()):
        FakeWorker(args.host, worker_port)
    secret = load_secret(args.secret_file)
    for role, worker_port in SIGNED.items():
        RegistrationHeartbeat(host, int(port), registration(role, args.host, worker_port),
                              Codec(secret, f"instance-{role}"), 0.5)
    for role, worker_port in UNSIGNED.items():
        UnsignedBeat(host, int(port), registration(role, args.host, worker_port), 0.5)
    for role, worker_port in WRONG_SECRET.items():
        RegistrationHeartbeat(host, int(port), registration(role, args.host, worker_port),
                              Codec(b"a guessed secret", f"intruder-{role}"), 0.5)
    threading.Event().wait()


def run_forge(args) -> None:
    """Bare registrations of a prefill instance at `--worker`, sent to `--to`, until killed."""
    from tests.unit.registrar.test_registrar_process import UnsignedBeat, registration

    host, port = args.to.rsplit(":", 1)
    worker_host, worker_port = args.worker.rsplit(":", 1)
    UnsignedBeat(host, int(port), registration("P", worker_host, int(worker_port)), 0.5)
    threading.Event().wait()


def run_client(args) -> None:
    """Wait until the router routes, then NUM_REQUESTS completions; print statuses and each worker's count."""
    import requests

    body = {"model": "m", "prompt": "hi", "max_tokens": 2}
    url = f"{args.router}/v1/completions"
    deadline = time.monotonic() + 60
    while True:
        try:
            if requests.post(url, json=body, timeout=10).status_code == 200:
                break
        except requests.RequestException:
            pass
        if time.monotonic() > deadline:
            raise SystemExit(f"{args.router} routed no request within 60 s")
        time.sleep(0.5)
    time.sleep(3.0)  # every registration, forged ones included, has arrived several times over
    workers = json.loads(args.workers)
    before = {name: _count(u) for name, u in workers.items()}
    statuses = [requests.post(url, json=body, timeout=10).status_code for _ in range(NUM_REQUESTS)]
    time.sleep(0.5)  # WRITE: a prefill leg may still be in flight
    counts = {name: _count(u) - before[name] for name, u in workers.items()}
    json.dump({"statuses": statuses, "counts": counts}, sys.stdout)


def _count(url: str) -> int:
    import requests

    return requests.get(f"{url}/count", timeout=10).json()["num_requests"]


def run_probe(args) -> None:
    """Print whether a TCP connection to ip:port opens ("open"), is refused, or times out."""
    try:
        with socket.create_connection((args.ip, args.port), timeout=5):
            print("open")
    except ConnectionRefusedError:
        print("refused")
    except OSError as e:
        print(f"unreachable: {e}")


def main() -> None:
    parser = argparse.ArgumentParser(description="(inside a namespace) the registrar test's processes")
    sub = parser.add_subparsers(dest="command", required=True)
    instances = sub.add_parser("instances")
    instances.add_argument("--registrar", required=True)
    instances.add_argument("--host", required=True)
    instances.add_argument("--secret-file", required=True)
    instances.set_defaults(func=run_instances)
    forge = sub.add_parser("forge")
    forge.add_argument("--to", required=True)
    forge.add_argument("--worker", required=True)
    forge.set_defaults(func=run_forge)
    client = sub.add_parser("client")
    client.add_argument("--router", required=True)
    client.add_argument("--workers", required=True)
    client.set_defaults(func=run_client)
    probe = sub.add_parser("probe")
    probe.add_argument("ip")
    probe.add_argument("port", type=int)
    probe.set_defaults(func=run_probe)
    args = parser.parse_args()
    args.func(args)


if __name__ == "__main__":
    main()
