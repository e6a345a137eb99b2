"""`write-two-host` and `read-two-host`: the bench's PD across two network namespaces.

The P and D of `write`/`read` with the same `vllm serve` flags (DeploymentRequest.up_options, as
on one host), but P and the router on host a and D on host b (pdserve.bench.hosts.two_host), so the KV
moves over NIXL (transport auto; UCX over TCP on the veth pair). The bench client stays in the
root namespace and reaches the router through a relay on 127.0.0.1:<port>
(pdserve.bench.hosts.netns_relay), standing where `pdserve up`'s front stands on one host. On the way
down, each side's transfer counters go to <log_dir>/transfers.json (which transport each side
attached, transfers completed, failed, recomputed). Needs root, `ip netns` and `unshare`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import subprocess
from typing import Iterator

from pdserve.bench.deployment import DeploymentRequest, Endpoint, check_model
from pdserve.bench.hosts import netns_relay, two_host
from pdserve.bench.samples import metric
from pdserve.errors import LaunchError

logger = logging.getLogger(__name__)

NOTE = ("write-two-host / read-two-host: write / read with the same vLLM flags, P and the router in one network "
        "namespace, D in another (veth pair, own PID namespaces), KV over NIXL (UCX TCP); the bench client reaches "
        "the router through a TCP relay on 127.0.0.1 (pdserve/bench/hosts/netns_relay.py).")
COUNTERS = {"attached_nixl": ("pdserve:kv_peers_attached_total", {"transport": "nixl"}),
            "attached_shm": ("pdserve:kv_peers_attached_total", {"transport": "shm"}),
            "completed": ("pdserve:kv_transfers_completed_total", {}),
            "failed": ("pdserve:kv_transfers_failed_total", {}),
            "recomputed": ("pdserve:kv_recomputed_total", {})}


def two_host_unavailable() -> str | None:
    """Why the two-host configurations cannot run here (None if they can); starts nothing."""
    if os.geteuid() != 0:
        return "needs root (it creates network namespaces with `ip netns` and PID namespaces with `unshare`)"
    for tool, package in (("ip", "iproute2"), ("unshare", "util-linux")):
        if shutil.which(tool) is None:
            return f"needs the `{tool}` command ({package}), which is not on PATH"
    try:
        done = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"`ip netns list` failed: {exc}"
    if done.returncode != 0:
        return f"`ip netns` does not work here: {done.stderr.strip() or f'exit code {done.returncode}'}"
    return None


@contextlib.contextmanager
def two_host_deployment(request: DeploymentRequest, port: int, startup_timeout_s: float) -> Iterator[Endpoint]:
    """Bring `request` up across the two namespaces; the endpoint is the relay on 127.0.0.1:`port`."""
    previous = signal.getsignal(signal.SIGTERM)
    options = request.up_options(port, startup_timeout_s)
    with two_host.TwoHostPD(options=options, log_dir=request.log_dir, connector_extra={}) as pd:
        if callable(previous):  # the bench's own SIGTERM handling (unwind like Ctrl-C) stays in force
            signal.signal(signal.SIGTERM, previous)
        router = netns_relay.Address(pd.hosts.ip("a"), two_host.ROUTER_PORT)
        with netns_relay.netns_relay(netns_relay.Address("127.0.0.1", port), pd.hosts.namespaces["a"], router,
                                     request.log_dir / "relay.log") as relay:
            model = check_model(pd.served_model("prefill"), request.model_dir, f"{pd.url('prefill')} (host a)")
            yield Endpoint(relay.url, model)
        _save_transfers(pd, request)


def _save_transfers(pd, request: DeploymentRequest) -> None:
    try:
        counts = {role: {key: metric(samples, name, **labels) for key, (name, labels) in COUNTERS.items()}
                  for role in ("prefill", "decode") for samples in [pd.metrics(role)]}
    except (LaunchError, ValueError) as exc:
        logger.warning("%s: could not read the transfer counters: %s", request.config, exc)
        return
    (request.log_dir / "transfers.json").write_text(json.dumps(counts, indent=2) + "\n")
