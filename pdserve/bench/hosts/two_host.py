"""PD across two "hosts" on one machine (netns.py), started with the per-host commands.

    with TwoHostPD(mode="write") as pd:          # router + P on host a, D on host b
        generations = pd.greedy(prompts)         # a client inside host a, through the router
        pd.metrics("decode")                     # D's Prometheus samples

`options` gives it the deployment `pdserve up` would run on one host (UpOptions: mode, model, token
budget per role, prefix caching, enforce_eager, cores divided as on one host), with the same `vllm
serve` flags per role, so the two can be compared; without it, the test harness's (enforce_eager,
512-token steps on both roles). Needs root (network and PID namespaces). Ports 30000-30022 inside the
namespaces (with tensor parallelism, 2 more after each instance's HTTP port per rank beyond the first). `python -m pdserve.bench.hosts.two_host client ...` is what runs inside a namespace for
the helpers below (wait, greedy, metrics, model).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import requests

from pdserve.bench.hosts.netns import TwoHosts
from pdserve.bench.samples import metric, parse_samples  # noqa: F401  (metric: re-exported)
from pdserve.compare import Step, fetch_greedy
from pdserve.control.secret import SECRET_FILE_ENV, generate_secret_file
from pdserve.errors import LaunchError
from pdserve.launch.cores import divide_cores
from pdserve.launch.env import cache_dir
from pdserve.launch.options import UpOptions

ROUTER_PORT, PREFILL_PORT, DECODE_PORT = 30000, 30010, 30020
CHUNK_TOKENS = 512
MAX_TOKENS = 32
TIMEOUTS = {"transfer_timeout": 30, "defer_timeout": 40, "handshake_timeout": 10, "release_grace": 2}
NETWORK = "10.200.0.0/24"
HOSTS = {"prefill": "a", "decode": "b"}


def harness_options(mode: str, model: str = "tiny", enforce_eager: bool = True) -> UpOptions:
    """The test harness's deployment: 512-token steps on both roles, prefix caching on."""
    return UpOptions(mode=mode, model=model, enforce_eager=enforce_eager,
                     prefill_budget=CHUNK_TOKENS, decode_budget=CHUNK_TOKENS)


class TwoHostPD:
    """Router and P on host a, D on host b; `transports` sets `--transport` per role.

    `options` replaces `mode`, `model` and `enforce_eager` (see the module docstring).
    `connector_extra`: more kv_connector_extra_config keys; None gives the harness's short
    deadlines (TIMEOUTS), {} the connector's defaults. `vllm_args`: more `vllm serve` arguments per role.
    """

    def __init__(self, mode: str = "write", transports: dict[str, str] | None = None, log_dir: Path | None = None,
                 connector_extra: dict | None = None, instance_env: dict[str, str] | None = None,
                 model: str = "tiny", enforce_eager: bool = True, vllm_args: dict[str, tuple[str, ...]] | None = None,
                 options: UpOptions | None = None):
        self.options = options or harness_options(mode, model, enforce_eager)
        self.mode = self.options.mode
        self.transports = {"prefill": "auto", "decode": "auto", **(transports or {})}
        # the processes' logs stay after the harness is gone, as the other PD tests' do
        self.log_dir = log_dir or cache_dir() / "test-logs" / f"two-host-{self.mode}-{time.strftime('%H%M%S')}"
        self.hosts = TwoHosts(self.log_dir)
        self.connector_extra = dict(TIMEOUTS if connector_extra is None else connector_extra)
        self.instance_env = instance_env or {}
        self.vllm_args = vllm_args or {}
        self.processes: dict[str, object] = {}
        self._scratch: tempfile.TemporaryDirectory | None = None

    @property
    def router_url(self) -> str:
        return f"http://{self.hosts.ip('a')}:{ROUTER_PORT}"

    def url(self, role: str) -> str:
        return f"http://{self.hosts.ip(HOSTS[role])}:{PREFILL_PORT if role == 'prefill' else DECODE_PORT}"

    def __enter__(self) -> TwoHostPD:
        from pdserve.model.build import resolve_model  # lazy: torch, only starting the deployment needs it

        self.options = replace(self.options, model=str(resolve_model(self.options.model)))
        self.hosts.__enter__()
        try:
            self._scratch = tempfile.TemporaryDirectory(prefix="pdserve-two-host-")
            secret = Path(self._scratch.name) / "secret"
            generate_secret_file(secret)
            a = self.hosts.ip("a")
            self.processes["router"] = self.hosts.start(
                "a", "router", [*_pdserve(), "router", "--host-ip", a, "--port", str(ROUTER_PORT)],
                env={SECRET_FILE_ENV: str(secret)})
            for role in HOSTS:
                self.processes[role] = self.hosts.start(HOSTS[role], role, self.instance_argv(role, secret),
                                                        env=self.instance_env)
            timeout = self.options.startup_timeout
            self.client("wait", "--url", self.router_url, "--models-url", self.url("prefill"),
                        "--timeout", str(timeout), timeout=timeout + 60)
        except BaseException:
            self.close()
            raise
        return self

    def instance_argv(self, role: str, secret: Path) -> list[str]:
        """`pdserve instance` for `role`: the vLLM flags a same-host deployment of `options` gives it."""
        o = self.options
        cores = divide_cores(o.cores, 1, 1, o.prefill_tp, o.decode_tp)
        core_list = (cores.prefill if role == "prefill" else cores.decode)[0]
        port = PREFILL_PORT if role == "prefill" else DECODE_PORT
        return [*_pdserve(), "instance", "--role", role, "--router", f"{self.hosts.ip('a')}:{ROUTER_PORT + 2}",
                "--host-ip", self.hosts.ip(HOSTS[role]), "--port", str(port), "--model", o.model,
                "--secret-file", str(secret), "--mode", self.mode, "--transport", self.transports[role],
                "--allowed-peers", NETWORK, "--cores", ",".join(map(str, core_list)), "--tp", str(o.tp(role)),
                "--connector-extra", json.dumps(self.connector_extra), "--",
                *o.vllm_args(role), *o.budget_args(role), *self.vllm_args.get(role, ())]

    def __exit__(self, *exc_info) -> None:
        self.close()

    def close(self) -> None:
        self.hosts.close()
        if self._scratch is not None:
            self._scratch.cleanup()
            self._scratch = None

    def client(self, *args: str, host: str = "a", timeout: float = 600) -> str:
        """This module's `client` subcommand on `host`; its stdout (LaunchError on failure)."""
        argv = [sys.executable, "-m", "pdserve.bench.hosts.two_host", "client", *args]
        return self._run(host, argv, f"client {args[0]}", timeout)

    def client_script(self, script: str, *args: str, host: str = "a", timeout: float = 1800) -> str:
        """Run `python script args...` on `host`; its stdout (LaunchError with its stderr on failure)."""
        return self._run(host, [sys.executable, script, *args], f"{Path(script).name} {' '.join(args[:2])}", timeout)

    def _run(self, host: str, argv: list[str], what: str, timeout: float) -> str:
        try:
            done = self.hosts.run(host, argv, timeout=timeout)
        except subprocess.TimeoutExpired:
            raise LaunchError(f"{what} on host {host} did not finish within {timeout:g} s") from None
        if done.returncode != 0:
            raise LaunchError(f"{what} on host {host} failed: {done.stderr[-2000:]}")
        return done.stdout

    def greedy(self, prompts: list, url: str | None = None, concurrency: int = 8) -> list:
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False, dir=self._scratch.name) as f:
            json.dump(prompts, f)
        out = self.client("greedy", "--url", url or self.router_url, "--models-url", url or self.url("prefill"),
                          "--prompts", f.name, "--concurrency", str(concurrency))
        return [[Step(t, lp, tuple(top)) for t, lp, top in gen] for gen in json.loads(out)]

    def outcomes(self, prompts: list, timeout: float = 300.0) -> list[dict]:
        """All `prompts` at once through the router, one request each, each allowed `timeout` s:
        per prompt {"status", "seconds", and for a 200 "steps" (compare.Step tuples)}."""
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False, dir=self._scratch.name) as f:
            json.dump(prompts, f)
        out = json.loads(self.client("outcomes", "--url", self.router_url, "--models-url", self.url("prefill"),
                                     "--prompts", f.name, "--timeout", str(timeout), timeout=timeout + 120))
        for row in out:
            if "steps" in row:
                row["steps"] = [Step(t, lp, tuple(top)) for t, lp, top in row["steps"]]
        return out

    def metrics(self, role: str) -> dict[str, float]:
        return json.loads(self.client("metrics", "--url", self.url(role), host=HOSTS[role]))

    def served_model(self, role: str = "prefill") -> str:
        """The model id `role`'s instance serves (the PD router does not answer /v1/models)."""
        return self.client("model", "--url", self.url(role), host=HOSTS[role]).strip()


def _pdserve() -> list[str]:
    return [sys.executable, "-m", "pdserve.cli"]


# ---- inside a namespace ------------------------------------------------------------------------

def add_client_parser(subparsers: argparse._SubParsersAction) -> None:
    client = subparsers.add_parser("client", help="(inside a namespace) talk to the deployment")
    client.add_argument("what", choices=("wait", "greedy", "outcomes", "metrics", "model"))
    client.add_argument("--url", required=True)
    client.add_argument("--timeout", type=float, default=600)
    client.add_argument("--prompts")
    client.add_argument("--models-url", help="an instance that answers /v1/models (the router does not)")
    client.add_argument("--concurrency", type=int, default=8)


def run_client(args) -> int:
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
    if args.what == "outcomes":  # every prompt its own request, all at once; each one's end recorded
        prompts = json.loads(Path(args.prompts).read_text())
        model = _model(args)
        with ThreadPoolExecutor(max(1, len(prompts))) as pool:
            json.dump(list(pool.map(lambda p: _outcome(args.url, p, model, args.timeout), prompts)), sys.stdout)
        return 0
    if args.what == "metrics":
        json.dump(parse_samples(requests.get(f"{args.url}/metrics", timeout=30).text), sys.stdout)
        return 0
    if args.what == "model":
        print(_model(args))
        return 0
    return 2


def _outcome(url: str, prompt, model: str, timeout: float) -> dict:
    """One greedy request: {"status": 200 and "steps", an HTTP status, or "timeout" / "error"; "seconds"}."""
    started = time.monotonic()
    try:
        steps = fetch_greedy(url, [prompt], max_tokens=MAX_TOKENS, model=model, timeout=timeout)[0]
        out = {"status": 200, "steps": [(s.token_id, s.logprob, list(s.top2)) for s in steps]}
    except requests.HTTPError as exc:
        out = {"status": exc.response.status_code, "error": exc.response.text[-300:]}
    except requests.Timeout:
        out = {"status": "timeout"}  # the client gave up and closed its connection
    except requests.RequestException as exc:
        out = {"status": "error", "error": str(exc)[-300:]}
    return {**out, "seconds": round(time.monotonic() - started, 2)}


def _model(args) -> str:
    return requests.get(f"{args.models_url or args.url}/v1/models", timeout=10).json()["data"][0]["id"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_client_parser(parser.add_subparsers(dest="command", required=True))
    return run_client(parser.parse_args())


if __name__ == "__main__":
    raise SystemExit(main())
