"""PD across two "hosts" on one machine (pdserve.launch.netns), started with the per-host commands.

    with TwoHostPD(mode="write") as pd:          # router + P on host a, D on host b
        generations = pd.greedy(prompts)         # a client inside host a, through the router
        pd.metrics("b")                          # D's Prometheus samples

Also a command line: `python scripts/two_host.py up --mode write` brings the deployment up and
holds it until Ctrl-C; `client ...` is what runs inside a namespace for the helpers above.
Needs root (network and PID namespaces). Ports 30000-30022 inside the namespaces.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

ROUTER_PORT, PREFILL_PORT, DECODE_PORT = 30000, 30010, 30020
CHUNK_TOKENS = 512
MAX_TOKENS = 32
TIMEOUTS = {"transfer_timeout": 30, "defer_timeout": 40, "handshake_timeout": 10, "release_grace": 2}
NETWORK = "10.200.0.0/24"


class TwoHostPD:
    """Router and P on host a, D on host b; `transports` sets `--transport` per role."""

    def __init__(self, mode: str = "write", transports: dict[str, str] | None = None, log_dir: Path | None = None,
                 connector_extra: dict | None = None, instance_env: dict[str, str] | None = None,
                 model: str = "tiny", enforce_eager: bool = True, vllm_args: dict[str, tuple[str, ...]] | None = None):
        from pdserve.launch.netns import TwoHosts

        self.mode = mode
        self.transports = {"prefill": "auto", "decode": "auto", **(transports or {})}
        self._scratch = tempfile.TemporaryDirectory(prefix="pdserve-two-host-")
        from pdserve.launch.env import cache_dir

        # the processes' logs stay after the harness is gone, as the other PD tests' do
        self.log_dir = log_dir or cache_dir() / "test-logs" / f"two-host-{mode}-{time.strftime('%H%M%S')}"
        self.hosts = TwoHosts(self.log_dir)
        self.connector_extra = {**TIMEOUTS, **(connector_extra or {})}
        self.instance_env = instance_env or {}
        self.processes: dict[str, object] = {}
        self.model, self.enforce_eager = model, enforce_eager
        self.vllm_args = vllm_args or {}  # more `vllm serve` arguments per role

    @property
    def router_url(self) -> str:
        return f"http://{self.hosts.ip('a')}:{ROUTER_PORT}"

    def url(self, role: str) -> str:
        return f"http://{self.hosts.ip('a' if role == 'prefill' else 'b')}:{PREFILL_PORT if role == 'prefill' else DECODE_PORT}"

    def __enter__(self) -> TwoHostPD:
        from pdserve.control.secret import generate_secret_file

        self.hosts.__enter__()
        try:
            secret = Path(self._scratch.name) / "secret"
            generate_secret_file(secret)
            self.secret = secret
            a = self.hosts.ip("a")
            self.processes["router"] = self.hosts.start(
                "a", "router", [*_pdserve(), "router", "--host-ip", a, "--port", str(ROUTER_PORT)])
            for role, host, port, core in (("prefill", "a", PREFILL_PORT, 0), ("decode", "b", DECODE_PORT, 1)):
                self.processes[role] = self.start_instance(role, host, port, core)
            self.client("wait", "--url", self.router_url, "--models-url", self.url("prefill"), "--timeout", "600",
                        timeout=660)
        except BaseException:
            self.close()
            raise
        return self

    def start_instance(self, role: str, host: str, port: int, core: int):
        from pdserve.launch.options import UpOptions
        from pdserve.model.build import resolve_model

        options = UpOptions(mode=self.mode, model=str(resolve_model(self.model)), port=port, enforce_eager=self.enforce_eager,
                            extra_vllm_args=("--max-num-batched-tokens", str(CHUNK_TOKENS)))
        argv = [*_pdserve(), "instance", "--role", role, "--router", f"{self.hosts.ip('a')}:{ROUTER_PORT + 2}",
                "--host-ip", self.hosts.ip(host), "--port", str(port), "--model", options.model,
                "--secret-file", str(self.secret), "--mode", self.mode, "--transport", self.transports[role],
                "--allowed-peers", NETWORK, "--cores", str(core),
                "--connector-extra", json.dumps(self.connector_extra), "--", *options.vllm_args(),
                *self.vllm_args.get(role, ())]
        return self.hosts.start(host, role, argv, env=self.instance_env)

    def __exit__(self, *exc_info) -> None:
        self.close()

    def close(self) -> None:
        self.hosts.close()
        self._scratch.cleanup()

    def client(self, *args: str, host: str = "a", timeout: float = 600) -> str:
        return self.client_script(str(Path(__file__).resolve()), "client", *args, host=host, timeout=timeout)

    def client_script(self, script: str, *args: str, host: str = "a", timeout: float = 1800) -> str:
        """Run `python script args...` on `host`; its stdout (RuntimeError with its stderr on failure)."""
        done = self.hosts.run(host, [sys.executable, script, *args], timeout=timeout)
        if done.returncode != 0:
            raise RuntimeError(f"{Path(script).name} {' '.join(args[:2])} on host {host} failed: {done.stderr[-2000:]}")
        return done.stdout

    def greedy(self, prompts: list, url: str | None = None, concurrency: int = 8) -> list:
        from pdserve.compare import Step

        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False, dir=self._scratch.name) as f:
            json.dump(prompts, f)
        out = self.client("greedy", "--url", url or self.router_url, "--models-url", url or self.url("prefill"),
                          "--prompts", f.name, "--concurrency", str(concurrency))
        return [[Step(t, lp, tuple(top)) for t, lp, top in gen] for gen in json.loads(out)]

    def metrics(self, role: str) -> dict[str, float]:
        host = "a" if role == "prefill" else "b"
        return json.loads(self.client("metrics", "--url", self.url(role), host=host))


def metric(samples: dict[str, float], name: str, **labels: str) -> float:
    total = 0.0
    for key, value in samples.items():
        base, _, rest = key.partition("{")
        if base == name and all(f'{k}="{v}"' in rest for k, v in labels.items()):
            total += value
    return total


def _pdserve() -> list[str]:
    return [sys.executable, "-m", "pdserve.cli"]


# ---- inside a namespace ------------------------------------------------------------------------

def _client(args) -> int:
    import requests

    from pdserve.compare import fetch_greedy

    if args.what == "wait":
        deadline = time.monotonic() + args.timeout
        while time.monotonic() < deadline:
            try:
                body = {"model": _model(args), "prompt": [11, 12, 13], "max_tokens": 1}
                if requests.post(f"{args.url}/v1/completions", json=body, timeout=60).status_code == 200:
                    return 0
            except (requests.RequestException, ValueError, KeyError):
                pass
            time.sleep(1.0)
        print(f"{args.url} did not route a request within {args.timeout} s", file=sys.stderr)
        return 1
    if args.what == "greedy":
        prompts = json.loads(Path(args.prompts).read_text())
        generations = fetch_greedy(args.url, prompts, max_tokens=MAX_TOKENS, concurrency=args.concurrency,
                                   model=_model(args))
        json.dump([[(s.token_id, s.logprob, list(s.top2)) for s in g] for g in generations], sys.stdout)
        return 0
    if args.what == "metrics":
        out = {}
        for line in requests.get(f"{args.url}/metrics", timeout=30).text.splitlines():
            if line and not line.startswith("#"):
                key, _, value = line.rpartition(" ")
                out[key] = float(value)
        json.dump(out, sys.stdout)
        return 0
    return 2


def _model(args) -> str:
    import requests

    return requests.get(f"{args.models_url or args.url}/v1/models", timeout=10).json()["data"][0]["id"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up")
    up.add_argument("--mode", default="write", choices=("write", "read"))
    up.add_argument("--transport", default="auto")
    client = sub.add_parser("client")
    client.add_argument("what", choices=("wait", "greedy", "metrics"))
    client.add_argument("--url", required=True)
    client.add_argument("--timeout", type=float, default=600)
    client.add_argument("--prompts")
    client.add_argument("--models-url", help="an instance that answers /v1/models (the router does not)")
    client.add_argument("--concurrency", type=int, default=8)
    args = parser.parse_args()
    if args.command == "client":
        return _client(args)
    with TwoHostPD(args.mode, {"prefill": args.transport, "decode": args.transport}) as pd:
        print(f"up: router {pd.router_url}, logs in {pd.log_dir}; Ctrl-C stops", flush=True)
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            return 0


if __name__ == "__main__":
    raise SystemExit(main())
