"""`nixl` mode: vLLM's own NixlConnector, 1P+1D behind vllm-router's PD mode with static URLs.

The prefill instance (kv_producer) runs on the first core, the decode instance (kv_consumer) on
the second (with --prefill-tp/--decode-tp, a core per rank from the first ones, as
launch.cores.divide_cores shares them where there are fewer); vllm-router (`--vllm-pd-disaggregation`, kv connector nixl by default) sends each
request to P with max_tokens=1 and forwards P's kv_transfer_params to D, which pulls the KV
blocks over NIXL/UCX on loopback. This is the baseline pdserve's own connector is measured against.

Two CPU workarounds are applied to these instances only, by pdserve's `sitecustomize` on their
PYTHONPATH and the variables that switch them on (pdserve/vllm_patches/nixl_cpu.py; see
shared/research/pd-effect-cpu.md §2): without them P's model forward is moved onto D's core and a
busy-polling progress thread halves both.

nixl is not part of the base install: `ensure_nixl()` installs it (nixl 1.5.2 pins a nixl-cu12 that
PyPI lacks, so both wheels are fetched without dependencies and installed with --no-deps).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from pdserve.errors import ConfigError, LaunchError
from pdserve.launch.cores import divide_cores, sharing_warning
from pdserve.launch.modes import Deployment, plain_instance, register
from pdserve.launch.options import UpOptions
from pdserve.launch.router import RouterSpec
from pdserve.vllm_patches.torch_extensions import STARTUP_DIRECTORY

NIXL_WHEELS = ("nixl==1.5.2", "nixl-cu12==1.5.1")
PTHR_DELAY_US = 2000

WORKAROUNDS_NOTE = (
    "nixl: vLLM NixlConnector (kv_buffer_device cpu, UCX over loopback: UCX_TLS=self,sm,tcp) with two CPU "
    "workarounds on its two instances only (pdserve/vllm_patches/nixl_cpu.py): (1) the NIXL "
    "worker's os.sched_setaffinity(0, [last core]) is a no-op, so P's compute thread stays on its own core; "
    f"(2) the UCX progress thread polls with a {PTHR_DELAY_US} us timeout instead of busy-spinning "
    "(nixl hardcodes pthrDelay=0). Without them NixlConnector on 2 cores has goodput 0 (pd-effect-cpu.md §2)."
)


def nixl_installed() -> bool:
    return importlib.util.find_spec("nixl") is not None and importlib.util.find_spec("nixl_cu12") is not None


def ensure_nixl() -> None:
    """Install nixl into this interpreter's environment unless it is there; LaunchError on failure."""
    if nixl_installed():
        return
    pip = [sys.executable, "-m", "pip"]
    with tempfile.TemporaryDirectory(prefix="pdserve-nixl-") as tmp:
        _pip([*pip, "download", "-q", "--no-deps", "-d", tmp, *NIXL_WHEELS])
        _pip([*pip, "install", "-q", "--no-deps", *sorted(str(p) for p in Path(tmp).glob("*.whl"))])
    importlib.invalidate_caches()
    if not nixl_installed():
        raise LaunchError("nixl was installed but cannot be imported")


def _pip(argv: list[str]) -> None:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise LaunchError(f"installing nixl failed: pip {argv[3]}: {done.stderr.strip()[-500:]}")


def _nixl_env(side_channel_port: int) -> dict[str, str]:
    inherited = os.environ.get("PYTHONPATH")
    return {
        "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
        "VLLM_NIXL_SIDE_CHANNEL_PORT": str(side_channel_port),
        "UCX_NET_DEVICES": "lo",
        "UCX_TLS": "self,sm,tcp",
        # each instance has a private /dev/shm (shm_namespace): UCX's posix shared memory must be
        # attached through /proc/<pid>/fd (UCX's default, pinned here), never by its /dev/shm name
        "UCX_POSIX_USE_PROC_LINK": "y",
        "PYTHONPATH": f"{STARTUP_DIRECTORY}{os.pathsep}{inherited}" if inherited else str(STARTUP_DIRECTORY),
        "PDSERVE_NIXL_NO_AFFINITY": "1",
        "PDSERVE_NIXL_PTHR_DELAY_US": str(PTHR_DELAY_US),
    }


def _transfer_config(role: str) -> str:
    return json.dumps({"kv_connector": "NixlConnector", "kv_role": role, "kv_buffer_device": "cpu"})


@register("nixl", "PD with vLLM's own NixlConnector over UCX loopback (P core 0, D core 1), the baseline; "
                  "needs nixl")
def nixl(options: UpOptions) -> Deployment:
    """P on the first core, D on the second (a core per rank from the first ones with TP), vllm-router
    in PD mode with static URLs."""
    if len(options.cores) < 2:
        raise ConfigError("nixl needs two cores")
    if not nixl_installed():
        raise ConfigError("nixl is not installed (pdserve bench installs it when the nixl config is requested)")
    cores = divide_cores(options.cores[:options.prefill_tp + options.decode_tp], 1, 1, options.prefill_tp,
                         options.decode_tp)
    roles = (("prefill", "kv_producer", cores.prefill[0]), ("decode", "kv_consumer", cores.decode[0]))
    instances = []
    for i, (role, kv_role, instance_cores) in enumerate(roles):
        base = plain_instance(options, role, options.port + 1 + i, instance_cores, role=role)
        instances.append(dataclasses.replace(
            base, extra_args=("--kv-transfer-config", _transfer_config(kv_role)),
            extra_env=_nixl_env(options.port + 5 + i)))
    prefill, decode = instances
    router = RouterSpec(port=options.port, prometheus_port=options.port + 3, policy="round_robin",
                        extra_args=("--vllm-pd-disaggregation", "--prefill", prefill.url, "--decode", decode.url))
    warnings = ((sharing_warning({i.name: (i.cores, i.tp) for i in instances}, len(options.cores)),) if cores.shared
                else ())
    # the side channels: one per instance whatever its tensor-parallel size (NixlConnector's scheduler side)
    return Deployment(tuple(instances), router, extra_ports=(options.port + 5, options.port + 6), warnings=warnings)
