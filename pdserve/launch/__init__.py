"""One-node launcher: `pdserve up` as a library.

    from pdserve import launch
    with launch.up(launch.UpOptions(mode="round-robin", model="tiny")) as cluster:
        cluster.wait_healthy(600)
        requests.post(cluster.endpoint + "/v1/completions", ...)
        cluster.instance_urls  # {"vllm0": "http://127.0.0.1:18001", ...}
        cluster.restarts       # {"vllm0": 0, "vllm1": 1, "router": 0, "front": 0}: a dead process comes back

A new mode is one function in launch/modes.py (or any module listed in modes.PLUGIN_MODULES):
    @register("write")
    def write(options: UpOptions) -> Deployment: ...
"""

from __future__ import annotations

import dataclasses

from pdserve.launch.arguments import is_hub_id
from pdserve.launch.cluster import Cluster
from pdserve.launch.instance import InstanceSpec, served_name_args
from pdserve.launch.modes import Deployment, known_modes, plain_instance, plan, register
from pdserve.launch.options import UpOptions
from pdserve.launch.router import RouterSpec

__all__ = ["Cluster", "Deployment", "InstanceSpec", "RouterSpec", "UpOptions", "known_modes", "plain_instance",
           "plan", "register", "up"]


def up(options: UpOptions) -> Cluster:
    """Plan the deployment for options.mode, build/resolve the model, and start it (not yet healthy)."""
    from pdserve.model.build import resolve_model  # lazy: torch, only building a model needs it

    plan(options)  # an unknown mode fails before any model is built
    model = options.model if is_hub_id(options.model) else str(resolve_model(options.model))
    resolved = dataclasses.replace(options, model=model,
                                   extra_vllm_args=(*served_name_args(options.model), *options.extra_vllm_args))
    cluster = Cluster(plan(resolved), log_dir=options.log_dir, restart=options.restart,
                      startup_timeout=options.startup_timeout)
    cluster.start()
    return cluster
