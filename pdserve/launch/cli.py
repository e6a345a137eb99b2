"""`pdserve up` and `pdserve demo`."""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from pdserve.errors import LaunchError
from pdserve.launch.cluster import Cluster
from pdserve.launch.env import runs_dir
from pdserve.launch.modes import Deployment, mode_descriptions
from pdserve.launch.options import DEFAULT_DRAIN_TIMEOUT, DEFAULT_PORT, RESTART_POLICIES, UpOptions, parse_bytes


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    up = subparsers.add_parser("up", help="start vLLM instance(s) and router; stop them on Ctrl-C/SIGTERM")
    _add_up_options(up)
    up.add_argument("--detach", action="store_true",
                    help="return once healthy, leaving a supervisor running; stop it with `kill PID`")
    up.add_argument("--ready-file", type=Path, help=argparse.SUPPRESS)
    up.set_defaults(func=run_up)
    demo = subparsers.add_parser("demo", help="bring up a deployment, run a short client session, shut down")
    _add_up_options(demo)
    demo.set_defaults(mode="write")  # the demo shows disaggregation; `--mode collocated` for the baseline
    demo.add_argument("--requests", type=int, default=8, help="number of client requests")
    demo.set_defaults(func=run_demo)


def _add_up_options(p: argparse.ArgumentParser) -> None:
    modes = mode_descriptions()
    width = max(map(len, modes))
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.epilog = "modes:\n" + "\n".join(f"  {name:<{width}}  {text}" for name, text in modes.items())
    p.add_argument("--mode", default="collocated", help=f"deployment: {' | '.join(modes)} (see below)")
    p.add_argument("--model", default="tiny", help="model directory, or tiny|small (built under models/ on first use)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help="client port; instances use the next ones")
    p.add_argument("--kv-cache", default="1GiB", help="KV cache size per instance (e.g. 1GiB, 512MiB)")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--no-prefix-caching", action="store_true", help="pass --no-enable-prefix-caching to vLLM")
    p.add_argument("--enforce-eager", action="store_true", help="skip torch.compile (faster start, slower decode)")
    p.add_argument("--vllm-args", default="", help="extra vLLM serve flags, one shell-quoted string")
    p.add_argument("--startup-timeout", type=float, default=600.0, help="seconds to wait for health")
    p.add_argument("--log-dir", type=Path, help="keep the processes' logs here after stop")
    p.add_argument("--drain-timeout", type=float, default=DEFAULT_DRAIN_TIMEOUT,
                   help="on Ctrl-C/SIGTERM, new requests are refused (503) and those in flight get this "
                        "many seconds to finish before everything stops (default %(default).0f)")
    p.add_argument("--prefill", type=int, default=1, metavar="N", dest="num_prefill",
                   help="prefill instances in PD modes (write, read), each registered with the router; cores "
                        "are divided among all instances (default 1)")
    p.add_argument("--decode", type=int, default=1, metavar="M", dest="num_decode",
                   help="decode instances in PD modes; the router pairs any prefill with any decode per "
                        "request (default 1)")
    p.add_argument("--prefill-budget", type=int, metavar="TOKENS",
                   help="--max-num-batched-tokens of the prefill instance(s) in PD modes (default: vLLM's)")
    p.add_argument("--decode-budget", type=int, metavar="TOKENS",
                   help="--max-num-batched-tokens of the decode instance(s) in PD modes; with adaptive "
                        "placement, the most prompt tokens decode prefills itself in one step (default 512; "
                        "fewer while it decodes, see --max-step-ms)")
    p.add_argument("--itl-target-ms", type=float, metavar="MS",
                   help="adaptive modes: decode prefills a prompt itself only while its running streams keep "
                        "their mean inter-token latency under this (default 50)")
    p.add_argument("--max-step-ms", type=float, metavar="MS",
                   help="adaptive modes: while decode has streams running, it prefills in chunks no step of "
                        "which takes longer than this, the largest gap a stream then sees (default 50)")
    p.add_argument("--slo", metavar="SLO",
                   help="adaptive modes: the SLO the deployment serves, e.g. 'ttft<500,mean_itl<40' or "
                        "'ttft<1000,max_gap<50' (the bench's syntax): decode keeps its streams' mean ITL under "
                        "the mean_itl bound and bounds its steps by max_gap, or not at all without one "
                        "(instead of --itl-target-ms / --max-step-ms)")
    p.add_argument("--prefill-serves-decode", action="store_true",
                   help="adaptive mode, one prefill instance: while decode's streams are loaded (their mean ITL "
                        "near the ITL target) it registers with the router as a decode instance too and serves "
                        "the requests sent to it whole (for decode-heavy traffic)")
    p.add_argument("--restart", choices=RESTART_POLICIES, default="on-failure",
                   help="once healthy, a process that dies is restarted (backoff 1 s doubling to 30 s; "
                        "default) or, with never, everything is stopped and pdserve exits non-zero")


def options_from(args: argparse.Namespace) -> UpOptions:
    return UpOptions(mode=args.mode, model=args.model, port=args.port, kv_cache_bytes=parse_bytes(args.kv_cache),
                     max_model_len=args.max_model_len, prefix_caching=not args.no_prefix_caching,
                     enforce_eager=args.enforce_eager, extra_vllm_args=tuple(shlex.split(args.vllm_args)),
                     startup_timeout=args.startup_timeout, log_dir=args.log_dir, restart=args.restart,
                     drain_timeout=args.drain_timeout, prefill_budget=args.prefill_budget,
                     decode_budget=args.decode_budget, itl_target_ms=args.itl_target_ms,
                     max_step_ms=args.max_step_ms, slo=args.slo, serve_decode=args.prefill_serves_decode,
                     num_prefill=args.num_prefill, num_decode=args.num_decode)


def instance_lines(deployment: Deployment) -> list[str]:
    """What `up` prints about each instance: name, URL, role and cores."""
    return [f"  instance {spec.name}: {spec.url} ({spec.role}, cores {','.join(map(str, spec.cores))})"
            for spec in deployment.instances]


class _Terminated(Exception):
    pass


def _raise_terminated(signum: int, frame: object) -> None:
    raise _Terminated()


def _stop(cluster: Cluster) -> None:
    """Stop without being interrupted: a second Ctrl-C/SIGTERM must not leave half a cleanup."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    cluster.stop()


def started(options: UpOptions) -> Cluster:
    """Start and wait; SIGTERM during start or serve unwinds through the caller's `finally`."""
    from pdserve import launch

    _log_to_stderr()
    signal.signal(signal.SIGTERM, _raise_terminated)
    start = time.monotonic()
    cluster = launch.up(options)
    for warning in cluster.deployment.warnings:
        logging.getLogger("pdserve.launch").warning("pdserve: warning: %s", warning)
    cluster.wait_healthy(options.startup_timeout)
    print(f"pdserve: {options.mode} on {options.model} healthy in {time.monotonic() - start:.1f} s", flush=True)
    return cluster


def _log_to_stderr() -> None:
    """The launcher's own log lines (restarts, /dev/shm fallback) go to stderr as they happen."""
    logger = logging.getLogger("pdserve.launch")
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False


def run_up(args: argparse.Namespace) -> int:
    options = options_from(args)
    if args.detach:
        return _detach(args)
    cluster = None
    announced = False  # a --detach supervisor told its parent it is healthy: from then on it owns its log
    try:
        cluster = started(options)
        print(f"OpenAI endpoint: {cluster.endpoint}/v1", flush=True)
        for line in instance_lines(cluster.deployment):
            print(line, flush=True)
        if args.ready_file:
            args.ready_file.write_text(f"{cluster.endpoint}\n")
            announced = True
        print("Ctrl-C to stop", flush=True)
        while cluster.failure is None:  # restarts (--restart on-failure) happen in the cluster's supervisor
            time.sleep(1)
        raise LaunchError(cluster.failure)
    except (KeyboardInterrupt, _Terminated):
        return 0
    finally:
        if cluster is not None:
            _stop(cluster)
            print("pdserve: stopped", file=sys.stderr, flush=True)
        if args.ready_file:  # a --detach supervisor: its ready file and log go with it, once it was healthy
            args.ready_file.unlink(missing_ok=True)  # (before that, the waiting parent reads the log's error)
            if announced:
                args.ready_file.with_suffix(".log").unlink(missing_ok=True)


def _detach(args: argparse.Namespace) -> int:
    """Run `pdserve up` (foreground form) as a supervisor in its own session; return once it is healthy."""
    runs_dir().mkdir(parents=True, exist_ok=True)
    fd, log_name = tempfile.mkstemp(prefix=f"up-{args.port}-", suffix=".log", dir=runs_dir())
    ready = Path(log_name).with_suffix(".ready")
    argv = [a for a in sys.argv[1:] if a != "--detach"] if sys.argv[1:2] == ["up"] else None
    if argv is None:
        raise LaunchError("--detach works from the command line only")
    child = subprocess.Popen([sys.executable, "-m", "pdserve.cli", *argv, "--ready-file", str(ready)],
                             stdout=fd, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    os.close(fd)
    deadline = time.monotonic() + args.startup_timeout + 60
    while not ready.exists():
        if child.poll() is not None or time.monotonic() > deadline:
            if child.poll() is None:
                child.terminate()
                child.wait(60)
            log = Path(log_name)
            text = log.read_text(errors="replace") if log.exists() else ""
            lines = [line for line in text.splitlines() if line.startswith("pdserve: error")]
            Path(log_name).unlink(missing_ok=True)
            raise LaunchError(lines[-1].removeprefix("pdserve: error: ") if lines else "supervisor did not start")
        time.sleep(0.5)
    endpoint = ready.read_text().strip()
    ready.unlink()
    print(f"OpenAI endpoint: {endpoint}/v1\nsupervisor pid {child.pid} (log {log_name}); stop with: kill {child.pid}")
    return 0


def run_demo(args: argparse.Namespace) -> int:
    from pdserve.launch.demo import client_session

    options = options_from(args)
    cluster = None
    try:
        cluster = started(options)
        print(f"OpenAI endpoint: {cluster.endpoint}/v1", flush=True)
        client_session(cluster.endpoint, args.requests, cluster.instance_urls)
        return 0
    except (KeyboardInterrupt, _Terminated):
        return 130
    finally:
        if cluster is not None:
            _stop(cluster)
            print("pdserve: stopped cleanly", flush=True)
