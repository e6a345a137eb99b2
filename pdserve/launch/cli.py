"""`pdserve up` and `pdserve demo`: their flags, checked as they are read, and their runs."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import signal
import subprocess
import sys
import time
from pathlib import Path

from pdserve import launch
from pdserve.errors import ConfigError, LaunchError
from pdserve.launch import arguments as arg
from pdserve.launch.cluster import Cluster
from pdserve.launch.config_file import apply as apply_config
from pdserve.launch.env import logs_root
from pdserve.launch.modes import Deployment, mode_descriptions, plan
from pdserve.launch.options import DEFAULT_DRAIN_TIMEOUT, DEFAULT_HOST, DEFAULT_PORT, RESTART_POLICIES, UpOptions

DEFAULT_MODE = "collocated"


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    up = subparsers.add_parser("up", help="start vLLM instance(s), router and front; stop them on Ctrl-C/SIGTERM",
                               description="Serve a model behind one OpenAI endpoint. The default mode, collocated,\n"
                                           "is plain vLLM serving (no PD); --mode write|read|adaptive disaggregate.")
    _add_up_options(up)
    up.add_argument("--detach", action="store_true",
                    help="return once healthy, leaving a supervisor running; stop it with `kill PID`")
    up.add_argument("--ready-file", type=Path, help=argparse.SUPPRESS)
    up.set_defaults(func=run_up)
    demo = subparsers.add_parser("demo", help="bring up a deployment, run a short client session, shut down")
    _add_up_options(demo)
    demo.set_defaults(mode="write")  # the demo shows disaggregation; `--mode collocated` for the baseline
    demo.add_argument("--requests", type=arg.positive_int, default=8, help="number of client requests")
    demo.set_defaults(func=run_demo)


def _add_up_options(p: argparse.ArgumentParser) -> None:
    modes = mode_descriptions()
    width = max(map(len, modes))
    p.epilog = "modes:\n" + "\n".join(f"  {name:<{width}}  {text}" for name, text in modes.items())
    p.set_defaults(config_vllm_args=(), apply_config=apply_config)
    p.add_argument("--config", type=Path, metavar="FILE.yaml",
                   help="read these flags from a YAML mapping (keys: flag names without --; vllm_args: a list); "
                        "flags given here override it (default: none)")
    p.add_argument("--mode", default=DEFAULT_MODE, choices=list(modes), metavar="MODE",
                   help=f"deployment: {' | '.join(modes)} (see below; {DEFAULT_MODE} is plain vLLM, no PD)")
    p.add_argument("--model", type=arg.model, default="tiny", metavar="MODEL",
                   help="a model directory, a Hugging Face id (org/name, resolved by vLLM), or a built-in "
                        "random-weight model built under <work-dir>/models on first use: tiny, small, or ARCH-tiny "
                        "(see make-model --arch)")
    p.add_argument("--host", type=arg.ip_address, default=DEFAULT_HOST, metavar="IP",
                   help="address the OpenAI endpoint listens on (0.0.0.0: every interface); instances and "
                        "router stay on loopback")
    p.add_argument("--port", type=arg.port, default=DEFAULT_PORT, metavar="PORT",
                   help="the OpenAI endpoint's port; instances and router use the next ones")
    p.add_argument("--kv-cache", type=arg.memory_size, default="1GiB", metavar="SIZE",
                   help="KV cache size per instance (divided among its tensor-parallel ranks), with a binary "
                        "unit (e.g. 1GiB, 512MiB)")
    p.add_argument("--max-model-len", type=arg.token_count, default=4096, metavar="TOKENS",
                   help="longest prompt plus output, in tokens (vLLM's --max-model-len)")
    p.add_argument("--no-prefix-caching", action="store_true", help="pass --no-enable-prefix-caching to vLLM")
    p.add_argument("--enforce-eager", action="store_true", help="skip torch.compile (faster start, slower decode)")
    p.add_argument("--vllm-args", type=arg.shell_words, default="", metavar="'FLAGS'", dest="vllm_args_string",
                   help="vLLM serve flags as one shell-quoted string, before those after -- (default: none)")
    p.add_argument("--startup-timeout", type=arg.seconds, default=600.0, metavar="SECONDS",
                   help="seconds to wait for every process to answer its health check")
    p.add_argument("--log-dir", type=arg.output_directory, metavar="DIR",
                   help="where the processes write their logs, kept after stop "
                        "(default: a new <work-dir>/runs/<time>-<mode>, printed at start)")
    p.add_argument("--drain-timeout", type=arg.seconds_or_zero, default=DEFAULT_DRAIN_TIMEOUT, metavar="SECONDS",
                   help="on Ctrl-C/SIGTERM, new requests are refused (503) and those in flight get this "
                        "many seconds to finish before everything stops")
    p.add_argument("--prefill", type=arg.instance_count, default=1, metavar="N", dest="num_prefill",
                   help="prefill instances in PD modes (write, read), each registered with the router; cores "
                        "are divided among all instances")
    p.add_argument("--decode", type=arg.instance_count, default=1, metavar="M", dest="num_decode",
                   help="decode instances in PD modes; the router pairs any prefill with any decode per request")
    p.add_argument("--prefill-tp", type=arg.tensor_parallel_size, default=1, metavar="N",
                   help="tensor-parallel size of each prefill instance in PD modes: its N ranks take N consecutive "
                        "handshake and notify ports and, where there are enough cores, a core of their own each")
    p.add_argument("--decode-tp", type=arg.tensor_parallel_size, default=1, metavar="M",
                   help="tensor-parallel size of each decode instance in PD modes (as --prefill-tp)")
    p.add_argument("--prefill-budget", type=arg.token_count, metavar="TOKENS",
                   help="--max-num-batched-tokens of the prefill instance(s) in PD modes (default: vLLM's)")
    p.add_argument("--decode-budget", type=arg.token_count, metavar="TOKENS",
                   help="--max-num-batched-tokens of the decode instance(s) in PD modes; with adaptive "
                        "placement, the most prompt tokens decode prefills itself in one step (default 512; "
                        "fewer while it decodes, see --max-step-ms)")
    p.add_argument("--itl-target-ms", type=arg.milliseconds, metavar="MS",
                   help="adaptive modes: decode prefills a prompt itself only while its running streams keep "
                        "their mean inter-token latency under this (default 50)")
    p.add_argument("--max-step-ms", type=arg.milliseconds, metavar="MS",
                   help="adaptive modes: while decode has streams running, it prefills in chunks no step of "
                        "which takes longer than this, the largest gap a stream then sees (default 50)")
    p.add_argument("--slo", type=arg.slo, metavar="SLO",
                   help="adaptive modes: the SLO the deployment serves, e.g. 'ttft<500,mean_itl<40' or "
                        "'ttft<1000,max_gap<50' (the bench's syntax): decode keeps its streams' mean ITL under "
                        "the mean_itl bound and bounds its steps by max_gap, or not at all without one "
                        "(instead of --itl-target-ms / --max-step-ms; default: none)")
    p.add_argument("--prefill-serves-decode", action="store_true",
                   help="adaptive mode, one prefill instance: while decode's streams are loaded (their mean ITL "
                        "near the ITL target) it registers with the router as a decode instance too and serves "
                        "the requests sent to it whole (for decode-heavy traffic)")
    p.add_argument("--kv-verify", choices=("digest", "off"), default=None,
                   help="PD modes: digest - decode checks a CRC-32 of every KV block it receives against "
                        "prefill's and recomputes on a mismatch; off - no check (default: the connector's, "
                        "digest for KV in host memory)")
    p.add_argument("--restart", choices=RESTART_POLICIES, default="on-failure",
                   help="once healthy, a process that dies is restarted (backoff 1 s doubling to 30 s) or, "
                        "with never, everything is stopped and pdserve exits non-zero")
    p.add_argument("vllm_args", nargs=argparse.REMAINDER, metavar="-- VLLM_FLAGS",
                   help="after --: `vllm serve` flags for every instance (e.g. -- --max-num-seqs 8)")


def options_from(args: argparse.Namespace) -> UpOptions:
    """The parsed flags as UpOptions; refuses what only the flags together can tell (ConfigError)."""
    if args.vllm_args and args.vllm_args[0] != "--":
        raise ConfigError(f"unrecognized argument {args.vllm_args[0]!r} (vLLM's own flags go after --)")
    return UpOptions(mode=args.mode, model=args.model, host=args.host, port=args.port, kv_cache_bytes=args.kv_cache,
                     max_model_len=args.max_model_len, prefix_caching=not args.no_prefix_caching,
                     enforce_eager=args.enforce_eager,
                     extra_vllm_args=(*args.config_vllm_args, *args.vllm_args_string, *args.vllm_args[1:]),
                     startup_timeout=args.startup_timeout, log_dir=args.log_dir, restart=args.restart,
                     drain_timeout=args.drain_timeout, prefill_budget=args.prefill_budget,
                     decode_budget=args.decode_budget, itl_target_ms=args.itl_target_ms,
                     max_step_ms=args.max_step_ms, slo=args.slo, serve_decode=args.prefill_serves_decode,
                     kv_verify=args.kv_verify,
                     num_prefill=args.num_prefill, num_decode=args.num_decode, prefill_tp=args.prefill_tp,
                     decode_tp=args.decode_tp)


def checked_options(args: argparse.Namespace) -> UpOptions:
    """The options to run, with their run directory; a deployment that cannot be planned is refused here."""
    options = with_run_dir(options_from(args))
    plan(options)
    return options


def with_run_dir(options: UpOptions) -> UpOptions:
    """Options whose log_dir is set: --log-dir, else a new run directory under the work dir (not yet created)."""
    if options.log_dir is not None:
        return options
    name = f"{time.strftime('%Y%m%d-%H%M%S')}-{options.mode}-{options.port}"
    return dataclasses.replace(options, log_dir=logs_root() / name)


def instance_lines(deployment: Deployment) -> list[str]:
    """What `up` prints about each instance: name, URL, role, tensor-parallel size and cores ('|' between ranks)."""
    return [f"  instance {spec.name}: {spec.url} ({spec.role}, {f'tp {spec.tp}, ' if spec.tp > 1 else ''}"
            f"cores {spec.cpu_binding})" for spec in deployment.instances]


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
    _log_to_stderr()
    signal.signal(signal.SIGTERM, _raise_terminated)
    print(f"pdserve: {options.mode} mode: {mode_descriptions()[options.mode]}", flush=True)
    print(f"pdserve: model {options.model}, logs in {options.log_dir}", flush=True)
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
    options = checked_options(args)
    if args.detach:
        return _detach(options)
    cluster = None
    try:
        cluster = started(options)
        print(f"OpenAI endpoint: {cluster.endpoint}/v1", flush=True)
        for line in instance_lines(cluster.deployment):
            print(line, flush=True)
        if args.ready_file:
            args.ready_file.write_text(f"{cluster.endpoint}\n")
        print("Ctrl-C to stop", flush=True)
        while cluster.failure is None:  # restarts (--restart on-failure) happen in the cluster's supervisor
            time.sleep(1)
        raise LaunchError(cluster.failure)
    except (KeyboardInterrupt, _Terminated):
        return 0
    finally:
        if cluster is not None:
            _stop(cluster)
            print(f"pdserve: stopped (logs in {options.log_dir})", file=sys.stderr, flush=True)
        if args.ready_file:
            args.ready_file.unlink(missing_ok=True)


def _detach(options: UpOptions) -> int:
    """Run `pdserve up` (foreground form) as a supervisor in its own session, its output in the run
    directory; return once it is healthy."""
    if "up" not in sys.argv[1:]:
        raise LaunchError("--detach works from the command line only")
    assert options.log_dir is not None
    options.log_dir.mkdir(parents=True, exist_ok=True)
    log, ready = options.log_dir / "up.log", options.log_dir / "up.ready"
    argv = [a for a in sys.argv[1:] if a != "--detach"]
    at = argv.index("up") + 1  # before any `-- VLLM_FLAGS`
    argv[at:at] = ["--log-dir", str(options.log_dir), "--ready-file", str(ready)]
    with log.open("ab") as out:
        child = subprocess.Popen([sys.executable, "-m", "pdserve.cli", *argv], stdout=out, stderr=subprocess.STDOUT,
                                 stdin=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + options.startup_timeout + 60
    while not ready.exists():
        if child.poll() is not None or time.monotonic() > deadline:
            if child.poll() is None:
                child.terminate()
                child.wait(60)
            lines = [line.split(": error: ", 1)[1] for line in log.read_text(errors="replace").splitlines()
                     if line.startswith("pdserve") and ": error: " in line]
            raise LaunchError(lines[-1] if lines else f"supervisor did not start (see {log})")
        time.sleep(0.5)
    endpoint = ready.read_text().strip()
    print(f"OpenAI endpoint: {endpoint}/v1\nsupervisor pid {child.pid} (log {log}); stop with: kill {child.pid}")
    return 0


def run_demo(args: argparse.Namespace) -> int:
    from pdserve.launch.demo import client_session  # lazy: requests, only `pdserve demo` needs it

    options = checked_options(args)
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
            print(f"pdserve: stopped cleanly (logs in {options.log_dir})", flush=True)
